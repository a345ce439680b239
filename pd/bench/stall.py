"""`pd-bench stall`: how long one large request holds a worker's event loop.

`/health` is polled every `--poll-ms` while prompts of `--sizes` MiB arrive, one at a time, as
text, as a chat message and as a token-id list; the worst `/health` latency while each is in
flight is what a router's health check (and every other request on that worker) waited. A
request must be answered (200, or a clear 4xx: a prompt that cannot fit the context) and no
check may wait longer than `--max-stall-ms`, else the exit code is 1.

Without `--url` it starts one prefill worker (the issue's case: a prompt sent straight to P) on
the default model and stops it at the end; `--url` measures any running worker or router.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp
import orjson

from pd.protocol import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENIZE_CHARS,
)
from pd.protocol.tools import MAX_TOOLS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running worker or router (default: start a prefill worker)")
    p.add_argument("--sizes", default="1,4,7", help="prompt sizes in MiB, comma-separated")
    p.add_argument(
        "--kinds",
        default="text,chat,ids",
        help="prompt forms (text, chat, ids: at each of --sizes) and field kinds, each at its "
        f"bound and past it ({', '.join(FIELD_KINDS)}; 'all': every kind)",
    )
    p.add_argument("--poll-ms", type=float, default=10.0, help="/health poll interval")
    p.add_argument("--max-stall-ms", type=float, default=50.0, help="worst /health wait allowed")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the started worker")
    p.add_argument(
        "--role", default="prefill", help="role of the started worker (field kinds: both)"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")


# Field kinds: one request at each bound a client may send (docs/security.md), answered 200, and
# one past it, answered 400; measured once each, whatever --sizes says.
FIELD_KINDS = (
    "stop", "bad_words", "token_ids", "logit_bias", "tools", "messages", "tokenize", "echo",
)  # fmt: skip
PROMPT_KINDS = ("text", "chat", "ids")


def field_bodies(kind: str) -> list[tuple[str, bytes, int]]:
    """[(path, body, status expected)] of a field kind: at its bound, then past it."""
    chat, done = "/v1/chat/completions", "/v1/completions"
    base: dict[str, Any] = {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True}

    def both(path: str, at: dict, past: dict) -> list[tuple[str, bytes, int]]:
        return [(path, orjson.dumps(at), 200), (path, orjson.dumps(past), 400)]

    if kind == "stop":  # checked on every token: long strings that almost match
        stops = [("a" * (MAX_STOP_CHARS - 1)) + str(i % 10) for i in range(MAX_STOP)]
        many = [f"stop{i}" for i in range(100_000)]
        return both(done, {**base, "stop": stops}, {**base, "stop": many})
    if kind == "bad_words":
        words = [f"w{i}" + "x" * (MAX_BAD_WORD_CHARS - 8) for i in range(MAX_BAD_WORDS)]
        return both(done, {**base, "bad_words": words}, {**base, "bad_words": [*words, "more"]})
    if kind == "token_ids":
        allowed = [t % 1000 for t in range(MAX_ALLOWED_TOKEN_IDS)]  # ids any vocabulary has
        stop_ids = list(range(MAX_STOP_TOKEN_IDS))
        at = {**base, "allowed_token_ids": allowed, "stop_token_ids": stop_ids}
        return both(done, at, {**at, "allowed_token_ids": [*allowed, 1]})
    if kind == "logit_bias":
        bias = {str(t): 1.0 for t in range(MAX_LOGIT_BIAS)}
        return both(
            done, {**base, "logit_bias": bias}, {**base, "logit_bias": {**bias, "99999": 1.0}}
        )
    if kind == "tools":
        tool: dict[str, Any] = {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {f"p{i}": {"type": "string"} for i in range(16)},
                },
            },
        }
        tools = [{**tool, "function": {**tool["function"], "name": f"f{i}"}}
                 for i in range(MAX_TOOLS)]  # fmt: skip
        body = {"messages": [{"role": "user", "content": "Call a tool."}], "max_tokens": 16}
        return both(chat, {**body, "tools": tools}, {**body, "tools": [*tools, tool]})
    if kind == "messages":
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"}
                    for i in range(MAX_MESSAGES - 1)] + [{"role": "user", "content": "hi"}]  # fmt: skip
        body = {"max_tokens": 16}
        return both(
            chat, {**body, "messages": messages}, {**body, "messages": [*messages, *messages]}
        )
    if kind == "tokenize":  # the longest text counted, with each token's string, then longer
        line = "the quick brown fox jumps over a lazy dog "
        text = (line * (MAX_TOKENIZE_CHARS // len(line) + 1))[:MAX_TOKENIZE_CHARS]
        at = {"prompt": text, "return_token_strs": True}
        return both("/tokenize", at, {**at, "prompt": text + "x"})
    if kind == "echo":  # the prompt part for n choices: built once per prompt
        prompt = "the quick brown fox jumps over a lazy dog " * 150  # ~1,500 tokens
        body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 5,
                "prompt_logprobs": 5, "n": 16}  # fmt: skip
        return [(done, orjson.dumps(body), 200)]
    raise ValueError(f"unknown kind {kind!r}")


def _as_expected(r: dict[str, Any]) -> bool:
    """A field kind's answer: past the bound a 400; at it a 200, or a 400 that only says the
    prompt is too long for this model's context (the request was read, rendered and counted:
    what the bench measures)."""
    expected = r.get("expected", r["status"])
    if expected == 200 and r["status"] == 400:
        return r["code"] == "context_length_exceeded"
    return bool(r["status"] == expected)


def body_of(kind: str, nbytes: int) -> tuple[str, bytes]:
    """(path, body) of a prompt of about `nbytes`: English-like words, or token ids."""
    words = "the quick brown fox jumps over a lazy dog "
    text = (words * (nbytes // len(words) + 1))[:nbytes]
    if kind == "text":
        return "/v1/completions", orjson.dumps({"prompt": text, "max_tokens": 4})
    if kind == "chat":
        messages = [{"role": "user", "content": text}]
        return "/v1/chat/completions", orjson.dumps({"messages": messages, "max_tokens": 4})
    if kind == "ids":
        ids = [1234] * (nbytes // 5)  # "1234," is 5 bytes
        return "/v1/completions", orjson.dumps({"prompt": ids, "max_tokens": 4})
    raise ValueError(f"unknown prompt kind {kind!r}")


async def _health_latencies(
    http: aiohttp.ClientSession, url: str, every_s: float, stop: asyncio.Event
) -> list[float]:
    out: list[float] = []
    while not stop.is_set():
        t = time.perf_counter()
        async with http.get(f"{url}/health") as r:
            await r.read()
        out.append(time.perf_counter() - t)
        await asyncio.sleep(every_s)
    return out


async def measure(url: str, kind: str, mib: float, poll_s: float) -> dict[str, Any]:
    path, body = body_of(kind, int(mib * (1 << 20)))
    return await measure_one(url, kind, mib, poll_s, path, body)


async def measure_one(
    url: str, kind: str, mib: float, poll_s: float, path: str, body: bytes
) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        stop = asyncio.Event()
        poller = asyncio.create_task(_health_latencies(http, url, poll_s, stop))
        await asyncio.sleep(0.2)  # a few checks before, as a baseline
        t = time.perf_counter()
        async with http.post(
            url + path, data=body, headers={"Content-Type": "application/json"}
        ) as r:
            answer = await r.read()
            status = r.status
        took = time.perf_counter() - t
        await asyncio.sleep(0.1)
        stop.set()
        lat = await poller
    code = None
    if status != 200:
        error = orjson.loads(answer).get("error") or {}
        code = error.get("code")
    return {
        "kind": kind,
        "mib": mib,
        "status": status,
        "code": code,
        "answer_s": round(took, 3),
        "health_checks": len(lat),
        "health_p50_ms": round(statistics.median(lat) * 1e3, 1),
        "health_worst_ms": round(max(lat) * 1e3, 1),
    }


def _start_worker(threads: int, role: str) -> tuple[subprocess.Popen, str]:
    from pd.ports import free_port

    port = free_port()
    env = {**os.environ, "PD_CLUSTER_TOKEN": os.environ.get("PD_CLUSTER_TOKEN", "pd-bench")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd.worker.main", "--role", role, "--port", str(port),
         "--threads", str(threads)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


async def _run(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    from pd.bench.pd import _wait_healthy

    await _wait_healthy(url, [])
    sizes = [float(s) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    if kinds == ["all"]:
        kinds = [*PROMPT_KINDS, *FIELD_KINDS]
    poll = args.poll_ms / 1e3
    out = [await measure(url, k, s, poll) for s in sizes for k in kinds if k in PROMPT_KINDS]
    for k in kinds:
        if k in FIELD_KINDS:
            for path, body, expected in field_bodies(k):
                r = await measure_one(url, k, len(body) / (1 << 20), poll, path, body)
                r["expected"] = expected
                out.append(r)
    return out


def run(args: argparse.Namespace) -> int:
    proc = None
    url = args.url
    if url is None:
        proc, url = _start_worker(args.threads, args.role)
    try:
        results = asyncio.run(_run(args, url.rstrip("/")))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if args.json:
        print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())
    else:
        print(f"{'request':>19} {'answer':>28} {'health p50':>11} {'worst':>9}")
        for r in results:
            answer = f"{r['status']} {r['code'] or ''} in {r['answer_s']:.2f}s"
            print(
                f"{r['mib']:>4.2g} MiB {r['kind']:<10} {answer:>28} {r['health_p50_ms']:>8.1f} ms"
                f" {r['health_worst_ms']:>6.1f} ms"
            )
    worst = max(r["health_worst_ms"] for r in results)
    bad = [r for r in results if r["status"] >= 500 or not _as_expected(r)]
    for r in bad:
        print(
            f"{r['kind']}: answered {r['status']} {r['code'] or ''}, expected {r.get('expected', '< 500')}"
        )
    print(f"worst /health wait: {worst:.1f} ms (allowed {args.max_stall_ms:g} ms)")
    return 0 if worst <= args.max_stall_ms and not bad else 1
