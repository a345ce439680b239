"""The handler's check of pd's internal fields (pd/signing.py) by the peer's real address: the
worker listens on every address and the test connects through this host's own non-loopback one,
so the handler sees another host. P's kv_transfer_params and the router's continuations pass
signed; unsigned ones pass from loopback only; anything else is a 403 before the role queues."""

from __future__ import annotations

import subprocess

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from pd.signing import CONTINUATION, FLAG, Guard, sign_continuation, sign_params
from pd.worker.api.server import make_app
from tests.worker.api.test_handler import StandInRole, worker

TOKEN = b"cluster-secret"
PARAMS = {"pd_version": 1, "transfer_id": "t1", "prompt_token_ids": [1, 2]}


def own_address() -> str | None:
    """One of this host's IPv4 addresses other than loopback (None: none, or no `ip`)."""
    try:
        out = subprocess.run(
            ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        addr = line.split()[3].split("/")[0]
        if not addr.startswith("127."):
            return addr
    return None


class TakesParams(StandInRole):
    takes_params = True  # as a decode worker's role


async def serve(role: StandInRole, token: bytes | None):
    w = worker(role)
    w.guard = Guard(token)
    server = TestServer(make_app(w), host="0.0.0.0")
    await server.start_server()
    return w, server


async def post(host: str, port: int, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"http://{host}:{port}/v1/completions",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        ) as resp:
            return resp.status, orjson.loads(await resp.read())


@pytest.fixture
def other_host() -> str:
    addr = own_address()
    if addr is None:
        pytest.skip("this host has no IPv4 address but loopback (or no `ip` command)")
    return addr


async def test_kv_params_need_ps_signature_from_another_host(other_host):
    role = TakesParams()
    w, server = await serve(role, TOKEN)
    try:
        port = server.port
        body = {"prompt": "hi", "max_tokens": 2}
        status, answer = await post(other_host, port, {**body, "kv_transfer_params": PARAMS})
        assert status == 403, answer
        assert (
            answer["error"]["code"] == "unsigned_internal_field"
            and FLAG in answer["error"]["message"]
        )
        assert not role.prompts  # refused before anything queued
        signed = sign_params(TOKEN, PARAMS)
        status, answer = await post(other_host, port, {**body, "kv_transfer_params": signed})
        assert status == 200, answer
        forged = {**signed, "prompt_token_ids": [1, 2, 3]}
        status, answer = await post(other_host, port, {**body, "kv_transfer_params": forged})
        assert status == 403, answer
        # From loopback an unsigned one passes (a one-host stack whose router has no token).
        status, answer = await post("127.0.0.1", port, {**body, "kv_transfer_params": PARAMS})
        assert status == 200, answer
        assert w.guard.refused == {
            "kv_transfer_params:unsigned": 1,
            "kv_transfer_params:bad_signature": 1,
        }
        scrape = w.metrics.render().decode()
        assert 'pd_internal_field_refusals_total{field="kv_transfer_params"} 2.0' in scrape
    finally:
        await server.close()


async def test_a_prefill_workers_own_params_are_not_checked(other_host):
    """P's input params ({do_remote_decode}) are a request for work, not pages to pull."""
    role = StandInRole()
    _, server = await serve(role, TOKEN)
    try:
        body = {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}
        status, answer = await post(other_host, server.port, body)
        assert status == 200, answer
    finally:
        await server.close()


@pytest.mark.parametrize("token", [TOKEN, None])
async def test_continuations_need_the_routers_signature_from_another_host(other_host, token):
    role = StandInRole()
    _, server = await serve(role, token)
    try:
        port = server.port
        body = {"prompt": "hi", "max_tokens": 4, CONTINUATION: {"output_token_ids": [3, 4]}}
        status, answer = await post(other_host, port, body)
        assert status == 403 and answer["error"]["param"] == CONTINUATION, answer
        signed = sign_continuation(TOKEN, body)
        status, answer = await post(other_host, port, signed)
        assert status == (200 if token else 403), answer
        if token:  # the signature binds the prompt: moved onto another, refused
            status, answer = await post(other_host, port, {**signed, "prompt": "ho"})
            assert status == 403, answer
        status, answer = await post("127.0.0.1", port, body)
        assert status == 200, answer
    finally:
        await server.close()
