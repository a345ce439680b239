"""A corpus of bad input, sent to the router (in process) and straight to a real prefill and
decode worker: every answer below 500 (an OpenAI-style error for each refusal), no worker dies
(the pid each /health reports stays the same), each worker's /health answers within 1 s all
along, and every page is free at the end. The corpus holds what hurt pd before (docs/security.md):
deep nesting, lists past their bounds, odd bytes and headers, grammar bombs, forged internal
fields, numbers past every range."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import orjson
import pytest

from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.transfer import nixl_available
from tests.e2e.processes import wait_pages_free
from tests.e2e.test_grammar_crashes import ref_chain, rule_chain
from tests.router.test_client_input import raw_request

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="P and D need a NIXL package"),
]

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
JSON_TYPE = b"Content-Type: application/json\r\n"


def chat(**fields) -> bytes:
    return orjson.dumps({"messages": MSG, "max_tokens": 4, **fields})


def completion(**fields) -> bytes:
    return orjson.dumps({"prompt": "hi", "max_tokens": 4, **fields})


def nested(depth: int) -> bytes:
    return b'{"prompt": "hi", "metadata": ' + b"[" * depth + b"]" * depth + b"}"


def corpus() -> list[tuple[str, str, bytes, bytes]]:
    """(name, path, extra header lines, body): each must be answered below 500."""
    deep_args = "[" * 200 + "]" * 200
    history = [*MSG, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
               "function": {"name": "f", "arguments": deep_args}}]},
               {"role": "tool", "tool_call_id": "c", "content": "x"}]  # fmt: skip
    tool = {"type": "function", "function": {"name": "f", "parameters": ref_chain(3000)}}
    cases: list[tuple[str, str, bytes, bytes]] = [
        ("nested 100", COMPLETION, b"", nested(100)),
        ("nested 1000", COMPLETION, b"", nested(1000)),
        ("nested 100k", COMPLETION, b"", nested(100_000)),
        ("deep tool-call arguments", CHAT, b"", chat(messages=history)),
        (
            "deep schema string",
            CHAT,
            b"",
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": deep_args},
                }
            ),
        ),  # fmt: skip
        ("100k stop strings", COMPLETION, b"", completion(stop=[f"s{i}" for i in range(100_000)])),
        ("16k bad words", COMPLETION, b"", completion(bad_words=[f"w{i}" for i in range(16_000)])),
        ("stop token ids", COMPLETION, b"", completion(stop_token_ids=list(range(100_000)))),
        ("allowed ids", COMPLETION, b"", completion(allowed_token_ids=list(range(300_000)))),
        ("logit bias", COMPLETION, b"", completion(logit_bias={str(i): 1 for i in range(5000)})),
        (
            "1000 tools",
            CHAT,
            b"",
            chat(
                tools=[
                    {
                        "type": "function",
                        "function": {"name": f"f{i}", "parameters": {"type": "object"}},
                    }
                    for i in range(1000)
                ]
            ),
        ),  # fmt: skip
        ("10k messages", CHAT, b"", chat(messages=MSG * 10_000)),
        (
            "$ref chain",
            CHAT,
            b"",
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "deep", "schema": ref_chain(3000)},
                }
            ),
        ),  # fmt: skip
        (
            "named tool $ref chain",
            CHAT,
            b"",
            chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}),
        ),  # fmt: skip
        ("lark chain", CHAT, b"", chat(structured_outputs={"grammar": rule_chain(3000)})),
        ("bad regex", CHAT, b"", chat(structured_outputs={"regex": "(((("})),
        ("n past the bound", COMPLETION, b"", completion(n=100_000)),
        ("n=16 x 10k tokens", COMPLETION, b"", completion(n=16, max_tokens=10_000)),
        (
            "max_tokens 2^63",
            COMPLETION,
            b"",
            b'{"prompt": "hi", "max_tokens": 9223372036854775808}',
        ),
        ("seed overflow", COMPLETION, b"", completion(n=4, seed=2**63 - 2)),
        ("top_logprobs 10^6", CHAT, b"", chat(logprobs=True, top_logprobs=10**6)),
        ("NaN temperature", COMPLETION, b"", b'{"prompt": "hi", "temperature": NaN}'),
        ("1e999", COMPLETION, b"", b'{"prompt": "hi", "temperature": 1e999}'),
        ("token id 2^40", COMPLETION, b"", completion(prompt=[2**40])),
        ("negative token id", COMPLETION, b"", completion(prompt=[-1])),
        ("lone surrogate", COMPLETION, b"", b'{"prompt": "\\ud800 hi", "max_tokens": 2}'),
        ("bytes not UTF-8", COMPLETION, b"", b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
        ("NUL in a string", COMPLETION, b"", completion(prompt="a\x00b", max_tokens=2)),
        ("not JSON", COMPLETION, b"", b"{{{"),
        ("a JSON list", COMPLETION, b"", b"[1, 2]"),
        ("empty", COMPLETION, b"", b""),
        ("wrong types", CHAT, b"", b'{"messages": "hi", "max_tokens": "4", "n": []}'),
        ("unknown field", COMPLETION, b"", completion(hello=1)),
        (
            "forged continuation",
            COMPLETION,
            b"",
            completion(pd_continuation={"output_token_ids": list(range(50))}),
        ),  # fmt: skip
        (
            "forged kv params",
            COMPLETION,
            b"",
            completion(
                kv_transfer_params={
                    "pd_version": 1,
                    "remote_engine_id": "x",
                    "remote_host": "10.0.0.1",
                    "remote_port": 1,
                    "transfer_id": "t",
                    "prompt_token_ids": [1],
                    "first_token_id": 1,
                    "page_ids": {"kv": [0, 1]},
                    "num_tokens": 1,
                    "page_size": 16,
                    "tp_size": 1,
                    "kv_layout": "NHD",
                    "dtype": "float32",
                    "model_fingerprint": "x",
                    "lease_ttl_s": 1.0,
                }
            ),
        ),  # fmt: skip
        ("tokenize 2 Mi", "/tokenize", b"", orjson.dumps({"prompt": "x " * (1 << 20)})),
        ("non-UTF-8 auth", COMPLETION, b"Authorization: Bearer \xff\xfe\r\n", completion()),
        ("non-UTF-8 room", COMPLETION, b"X-Room-Id: \xc3\x28\xff\r\n", completion(max_tokens=2)),
    ]
    return cases


async def test_a_bad_input_corpus_gets_no_5xx_and_kills_no_worker(fp32_pair, aiohttp_server):
    p_url, d_url = fp32_pair
    cfg = RouterConfig(port=0, prefill=(p_url,), decode=(d_url,), health_interval=0.5)
    router = await aiohttp_server(make_router(cfg))
    r_url = str(router.make_url("")).rstrip("/")
    targets = {"router": r_url, "prefill": p_url, "decode": d_url}
    async with aiohttp.ClientSession() as http:
        pids = {}
        for name in ("prefill", "decode"):
            pids[name] = (await (await http.get(targets[name] + "/health")).json())["pid"]
        slowest = {"prefill": 0.0, "decode": 0.0}
        stop = asyncio.Event()

        async def watch(name: str) -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                resp = await http.get(targets[name] + "/health")
                assert resp.status == 200 and (await resp.json())["pid"] == pids[name]
                slowest[name] = max(slowest[name], time.perf_counter() - t0)
                await asyncio.sleep(0.05)

        watchers = [asyncio.create_task(watch(n)) for n in slowest]
        answers: dict[tuple[str, str], int] = {}
        try:
            for target, url in targets.items():
                port = int(url.rsplit(":", 1)[1])
                for name, path, headers, body in corpus():
                    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode() + JSON_TYPE + headers
                    status, answer = await raw_request(port, head, body)
                    answers[target, name] = status
                    assert status < 500, (target, name, status, answer[:300])
                    if status >= 400:
                        error = orjson.loads(answer)["error"]
                        assert error["message"] and error["type"], (target, name, error)
        finally:
            stop.set()
            await asyncio.gather(*watchers)
        for name in ("prefill", "decode"):
            health = await (await http.get(targets[name] + "/health")).json()
            assert health["pid"] == pids[name] and health["status"] == "ok"
        assert max(slowest.values()) < 1.0, slowest
        refused = {k for k, s in answers.items() if s >= 400}
        # What must be refused everywhere (the rest may be served: the router strips forged
        # internal fields, a lone surrogate is text).
        for name in ("nested 1000", "100k stop strings", "$ref chain", "lark chain", "not JSON"):
            assert all((t, name) in refused for t in targets), name
        assert ("decode", "forged kv params") in refused and (
            "router",
            "forged kv params",
        ) not in refused
        print("slowest /health (s):", json.dumps(slowest))
        for url in (p_url, d_url):
            await wait_pages_free(http, url)
