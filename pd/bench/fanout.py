"""`pd-bench fanout`: the cost of `n = N` against N separate requests of the same prompt, through
router + P + D (the default model), in one run, side by side.

It starts a prefill and a decode worker (`--threads` cores shared out) and pd-router (every
request through P then D), then, per repeat, three ways to get N answers of one prompt:
- `n=N`: one request with `n: N` (P prefills once and makes one transfer; D forks N choices);
- `N separate, concurrent`: N requests of the same prompt at once (P's prefix cache may serve
  some of them a part of the prompt, depending on how their prefills overlap);
- `N separate, no cache`: the same with a `cache_salt` each, so P's prefix cache shares nothing
  between them (what N requests cost without a prefix cache).
Each mode runs on a salt of its own per repeat (no hit across modes). Prompt tokens P computed are
read from P's /metrics: pd_prefix_cache_queries_total - pd_prefix_cache_hits_total.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import time
import uuid

import aiohttp

from pd.bench.pd import _spawn, _wait_healthy
from pd.ports import free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=8, help="choices (and separate requests)")
    p.add_argument("--prompt-words", type=int, default=700, help="words of the shared prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores to share out")
    p.add_argument("--dtype", default="auto")


async def _computed(http: aiohttp.ClientSession, worker: str) -> float:
    text = await (await http.get(f"{worker}/metrics")).text()
    out = []
    for name in ("pd_prefix_cache_queries_total", "pd_prefix_cache_hits_total"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        assert m, f"{worker}/metrics lacks {name}"
        out.append(float(m.group(1)))
    return out[0] - out[1]


async def _post(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with http.post(f"{url}/v1/completions", json=body) as r:
        answer = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {answer}")
        return answer


async def _measure(args: argparse.Namespace, router: str, p_url: str) -> dict[str, list]:
    words = ("river valley town bridge market evening harvest story " * args.prompt_words).split()
    prompt = " ".join(words[: args.prompt_words])
    base = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 1.0,
            "ignore_eos": True}  # fmt: skip
    n = args.n
    results: dict[str, list] = {}
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await _post(http, router, {**base, "max_tokens": 2})  # warm up every path once
        for _ in range(args.repeats):
            run = uuid.uuid4().hex[:8]
            # Each mode its own salt in this repeat: no prefix hit across modes or repeats.
            modes = {
                f"n={n}": [{**base, "n": n, "cache_salt": run + "a"}],
                f"{n} separate, concurrent": [{**base, "cache_salt": run + "b"}] * n,
                f"{n} separate, no cache": [{**base, "cache_salt": f"{run}c{i}"} for i in range(n)],
            }
            for name, bodies in modes.items():
                before = await _computed(http, p_url)
                t0 = time.perf_counter()
                answers = await asyncio.gather(*(_post(http, router, b) for b in bodies))
                wall = time.perf_counter() - t0
                computed = await _computed(http, p_url) - before
                choices = sum(len(a["choices"]) for a in answers)
                completion = sum(a["usage"]["completion_tokens"] for a in answers)
                prompt_tokens = answers[0]["usage"]["prompt_tokens"]
                assert choices == n, (name, choices)
                results.setdefault(name, []).append((computed, wall, completion, prompt_tokens))
    return results


def run(args: argparse.Namespace) -> int:
    half = str(max(1, args.threads // 2))
    common = ["--dtype", args.dtype, "--max-model-len", "4096", "--threads", half]
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    procs = [
        _spawn("pd.worker.main", "--role", "prefill", "--port", str(p_port), *common),
        _spawn("pd.worker.main", "--role", "decode", "--port", str(d_port), *common),
    ]
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    router = f"http://127.0.0.1:{r_port}"
    try:
        asyncio.run(_wait_healthy(p_url, procs))
        asyncio.run(_wait_healthy(d_url, procs))
        procs.append(
            _spawn("pd.router.main", "--port", str(r_port), "--prefill", p_url, "--decode", d_url,
                   "--health-interval", "0.5", "--local-prefill-max-tokens", "0")
        )  # fmt: skip
        asyncio.run(_wait_healthy(router, procs))
        results = asyncio.run(_measure(args, router, p_url))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    first = next(iter(results.values()))
    print(f"prompt {first[0][3]} tokens, {args.n} answers of {args.max_tokens} tokens, "
          f"median of {args.repeats} repeats")  # fmt: skip
    print(f"{'mode':<26} {'P prompt tokens computed':>25} {'wall s':>8} {'completion tokens':>18}")
    for name, rows in results.items():
        computed = statistics.median(r[0] for r in rows)
        wall = statistics.median(r[1] for r in rows)
        completion = statistics.median(r[2] for r in rows)
        print(f"{name:<26} {computed:>25.0f} {wall:>8.2f} {completion:>18.0f}")
    return 0
