"""Router + simulated P + simulated D in one process: the real HTTP apps, engines, schedulers,
prefix caches, roles and transfer managers (the `sim` backend over the real bootstrap channel),
on llama-3.1-8b:h100 with the time scale turned down. A streamed chat completion comes back
with its usage right and the same text a co-located simulated worker gives; a second identical
prompt reports P's cached tokens; a continuation goes on where the stream left off; afterwards
every page is free, integrity ok, on both workers."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from pd.config import WorkerConfig
from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.sim import CostModel, parse_profile
from pd.worker.api.server import make_app
from pd.worker.build import build_worker
from tests.e2e.processes import wait_pages_free

PROFILE = "llama-3.1-8b:h100"
SCALE = 0.25  # modeled steps run 4x faster than on the GPU
TOKEN = "sim-pd-test-token-0123456789"
PROMPT = (
    "Tell me about the rivers of Europe, the mountains they rise in and the cities that grew up "
    "beside them, from the Danube and the Rhine to the Loire and the Tagus. "
)


def config(role: str, **kw) -> WorkerConfig:
    return WorkerConfig(
        simulate=PROFILE,
        time_scale=SCALE,
        role=role,
        port=0,
        cluster_token=TOKEN,
        **{"kv_pages": 512, **kw},  # 512: a walk of every page per check stays quick
    )


async def serve(aiohttp_server, role: str) -> str:
    worker = build_worker(config(role))
    server = await aiohttp_server(make_app(worker))  # test servers cancel handlers
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
async def stack(aiohttp_server):
    p, d, both = [await serve(aiohttp_server, r) for r in ("prefill", "decode", "both")]
    cfg = RouterConfig(
        port=0, prefill=(p,), decode=(d,), health_interval=0.2, local_prefill_max_tokens=0
    )
    router = str((await aiohttp_server(make_router(cfg))).make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 10
        while (await http.get(f"{router}/health")).status != 200:
            assert time.monotonic() < deadline, "the router never saw both workers healthy"
            await asyncio.sleep(0.05)
        yield http, router, p, d, both
        for url in (p, d, both):
            await wait_pages_free(http, url)


async def stream(http, url: str, body: dict) -> tuple[str, dict, str]:
    """A streamed chat completion: its text, its usage chunk and its finish reason."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, finish = "", {}, ""
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, usage, finish


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24, **kw}


async def test_a_streamed_chat_through_router_and_simulated_pd(stack):
    http, router, p, d, both = stack
    text, usage, finish = await stream(http, router, chat())
    ref_text, ref_usage, _ = await stream(http, both, chat())
    assert text == ref_text and finish == "length"  # the same ids on P then D as on one worker
    assert len(text.split()) == 24  # word tokens: one word each
    assert usage["completion_tokens"] == 24 and usage["prompt_tokens"] == ref_usage["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    prompt_tokens = usage["prompt_tokens"]
    assert prompt_tokens > 32

    again, usage2, _ = await stream(http, router, chat())
    assert again == text
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_tokens - 1) // 16 * 16, usage2  # P's full pages, less the last token

    for url, role in ((p, "prefill"), (d, "decode")):
        health = await (await http.get(f"{url}/health")).json()
        sim = health["simulate"]
        assert health["attention_backend"] == "simulated" and health["role"] == role
        assert sim["profile"] == "llama-3.1-8b:h100:tp1:rdma-400g" and sim["time_scale"] == SCALE
        assert sim["steps"] >= 2 and sim["real_s"] >= SCALE * sim["modeled_s"] * 0.999
    metrics = await (await http.get(f"{d}/metrics")).text()
    assert (
        "pd_sim_steps_total" in metrics
        and 'pd_sim_step_overshoot_seconds{quantile="0.99"}' in metrics
    )
    pages = -(-prompt_tokens // 16)
    page_bytes = parse_profile(PROFILE).model.kv_bytes_per_token * 16
    assert _metric(metrics, "pd_kv_transfer_bytes_total") == 2 * pages * page_bytes


async def test_a_continuation_through_simulated_pd_goes_on_where_the_stream_left(stack):
    """A migration's second leg (pd_continuation, docs/migration.md §3, sent to P then D as the
    router sends it) gives the rest of the uninterrupted answer: tokens are derived from the
    prompt and the position alone."""
    http, router, p, d, both = stack
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    whole = (await (await http.post(f"{both}/v1/completions", json=body)).json())["choices"][0]
    ids = await (await http.post(f"{both}/tokenize", json={"prompt": whole["text"]})).json()
    assert len(ids["tokens"]) == 12  # words re-tokenize as they were sampled
    cont = {**body, "pd_continuation": {"output_token_ids": ids["tokens"][:5]}}
    kv = {"do_remote_decode": True, "max_tokens": 12}
    first = await (
        await http.post(
            f"{p}/v1/completions", json={**cont, "max_tokens": 1, "kv_transfer_params": kv}
        )
    ).json()
    params = first["kv_transfer_params"]
    assert params["output_token_ids"] == ids["tokens"][:5]
    rest = await (
        await http.post(f"{d}/v1/completions", json={**cont, "kv_transfer_params": params})
    ).json()
    choice = rest["choices"][0]
    assert choice["text"].split() == whole["text"].split()[5:]  # the 7 words after the 5 given
    assert rest["usage"]["completion_tokens"] == 7 and choice["finish_reason"] == "length"


async def test_a_pull_takes_the_modeled_link_time(stack):
    """D's pd_kv_transfer_seconds of one pull: the link's latency plus the pages' bytes over its
    bandwidth (scaled), within what polling and a loaded machine add."""
    http, router, p, d, both = stack
    long = {"messages": [{"role": "user", "content": PROMPT * 40}], "max_tokens": 2}
    before = await _pull_seconds(http, d)
    _, usage, _ = await stream(http, router, long)
    took = await _pull_seconds(http, d) - before
    pages = -(-usage["prompt_tokens"] // 16)
    modeled = SCALE * CostModel(parse_profile(PROFILE)).kv_transfer_s(pages * 16)
    assert modeled <= took < modeled + 0.1, (took, modeled)


async def _pull_seconds(http, url: str) -> float:
    return _metric(await (await http.get(f"{url}/metrics")).text(), "pd_kv_transfer_seconds_sum")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name}")


async def test_structured_output_through_simulated_pd_follows_its_schema(stack):
    """P samples the first token under the grammar's mask and D goes on under its own: every
    token allowed (a refused one would end the request early), the same text as one worker."""
    http, router, p, d, both = stack
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "n": {"type": "integer"}},
        "required": ["city", "n"],
        "additionalProperties": False,
    }
    body = chat(
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    answers = []
    for url in (router, both):
        resp = await http.post(f"{url}/v1/chat/completions", json=body)
        answers.append((await resp.json())["choices"][0])
    (pd_answer, one) = answers
    assert pd_answer["message"]["content"] == one["message"]["content"]
    text = pd_answer["message"]["content"]
    assert text.startswith('{"city":"'), text
    if pd_answer["finish_reason"] == "stop":  # the grammar completed: valid JSON
        assert set(orjson.loads(text)) == {"city", "n"}
    else:
        assert pd_answer["finish_reason"] == "length"
