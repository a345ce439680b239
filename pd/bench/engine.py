"""`pd-bench engine`: decode throughput of one `--role both` worker, against the machine's bound.

For each `--quantizations` entry (default `none,int4`), in one run:

1. in this process: the model's linear layers (the same code the worker runs, built with that
   quantization) are timed alone at each stream count (`linear_ms`: every layer's projections
   and the LM head on a batch of that many rows, median of several), and the bytes a decode step
   reads are counted: the weights (and scales), plus the KV of every stream at its mean context;
2. a worker process is started with `--quantization` and `--threads`; for each concurrency N it
   gets N streaming completions of `--max-tokens` tokens at once (`ignore_eos`, greedy) and
   decode tokens/s is measured: tokens after each stream's first, over the time from the first
   stream's first token to the last stream's last one; `step_ms` = N / that rate.

Each figure is printed beside the CPU that gave it (model name and the flags that pick torch's
kernels: AVX-512, AVX512-BF16, AMX, AVX-VNNI; `cpu_info.py`), and a quantization whose decode
rate at a stream count is below `none`'s (when both ran) is marked slower than the unquantized
weights there (`slower_than_none`): a slow path `--quantization auto` would not pick.

The bound: the machine's read bandwidth (`torch.sum` over 1 GiB with `--threads` threads, best
of 5) over the bytes of one step gives the steps per second a step that only streamed its
weights and KV would reach: `bound_tok_s` = N x that, and `share_of_bound` = tok_s / bound_tok_s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import torch

PROMPT_TOKENS = 16  # about what each stream's prompt is ("Request i: write a long story ...")


def linear_layers(model: Any, h: torch.Tensor, o: torch.Tensor, m: torch.Tensor) -> None:
    """Every linear layer of a decode step on rank 0 (QKV, O, MLP of each layer) and the LM
    head, on inputs of the step's rows: what the step's matmuls cost without the rest."""
    for layer in model.ranks[0].layers:
        layer.qkv(h)
        layer.o(o)
        layer.gate_up(h)
        layer.down(m)
    model.lm_head(h)


def mark_slower_than_none(runs: list[dict]) -> None:
    """Set each quantized run's `slower_than_none`: its tok/s below the `none` run's of the same
    compute dtype at the same stream count (None where that did not run)."""
    none = {(r.get("dtype"), r["streams"]): r["tok_s"] for r in runs if r["quantization"] == "none"}
    for r in runs:
        if r["quantization"] != "none":
            base = none.get((r.get("dtype"), r["streams"]))
            r["slower_than_none"] = None if base is None else r["tok_s"] < base


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running worker (default: start one per configuration)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    p.add_argument(
        "--configs",
        default="",
        help="comma-separated worker configurations: auto (the default worker: --dtype auto "
        "--quantization auto), DTYPE/QUANTIZATION (e.g. bfloat16/int4, float32/fbgemm-int8), "
        "or all (auto and every dtype with every weight format this machine runs); replaces "
        "--dtype/--quantizations",
    )
    p.add_argument("--dtype", default="auto", help="compute dtype of the started worker")
    p.add_argument(
        "--quantizations",
        default="none,int4",
        help="comma-separated --quantization values, each with --dtype (without --configs)",
    )
    p.add_argument("--threads", type=int, default=0, help="worker threads (0: all cores)")
    p.add_argument("--worker-args", default="", help="extra flags for the started worker")
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=0,
        help="also measure prefill: prompt tokens/s of prompts this long (max_tokens 1; 0: no)",
    )
    p.add_argument(
        "--quality",
        action="store_true",
        help="also each explicit configuration's perplexity over fp32's (the bound auto keeps)",
    )
    p.add_argument(
        "--compare-llama-cpp",
        action="store_true",
        help="also llama-cpp-python's server on the same GGUF and threads (one stream and "
        "prefill), when installed (pip install 'llama-cpp-python[server]'); the targets' ratios",
    )
    p.add_argument(
        "--constrained",
        action="store_true",
        help="also measure each stream count with a JSON schema (response_format) beside the "
        "same load unconstrained, and the grammar's compile and mask costs",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


# The --constrained load: every stream writes one long JSON string (so the grammar runs for the
# whole answer, as in a schema's free-text field).
STORY_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40}, "story": {"type": "string"}},
    "required": ["title", "story"],
}


def grammar_costs(samples: int = 200) -> dict:
    """Compile time of STORY_SCHEMA (cold: a new compiler; cached: the same grammar again) and
    the mask time per token (`TokenRules.fill_mask`) along a walk through its states."""
    import json as _json

    import numpy as np

    from pd.protocol import Constraint
    from pd.worker.checkpoint import default_model_path, load_tokenizer
    from pd.worker.text.grammar import GrammarCompiler
    from pd.worker.text.token_rules import TokenRules, allowed_ids

    tok = load_tokenizer(default_model_path())
    constraint = Constraint("json_schema", _json.dumps(STORY_SCHEMA))
    compiler = GrammarCompiler(tok, tok.vocab_size)
    t = time.perf_counter()
    compiler.matcher_now(constraint)
    cold = time.perf_counter() - t
    cached = []
    for _ in range(20):
        t = time.perf_counter()
        rules = TokenRules(compiler.words, grammar=compiler.matcher_now(constraint))
        cached.append(time.perf_counter() - t)
    masks: list[float] = []
    out: list[int] = []
    row = np.empty(compiler.words, np.int32)
    for i in range(samples):
        row.fill(-1)
        t = time.perf_counter()
        rules.fill_mask(row, out)
        masks.append(time.perf_counter() - t)
        ok = [int(x) for x in allowed_ids(row, tok.vocab_size) if int(x) not in tok.eos_token_ids]
        token = ok[(i * 7919) % len(ok)]  # a spread of the allowed tokens, deterministic
        if not rules.accept(token) or rules.complete:
            break
        out.append(token)
    compiler.close()
    return {
        "compile_cold_ms": round(1000 * cold, 2),
        "compile_cached_ms": round(1000 * statistics.median(cached), 3),
        "mask_us_p50": round(1e6 * statistics.median(masks), 1),
        "mask_us_max": round(1e6 * max(masks), 1),
        "mask_samples": len(masks),
    }


def read_gbps(threads: int, gib: float = 1.0) -> float:
    """The machine's read bandwidth as torch sees it: a sum over `gib` GiB, best of 5."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def step_bytes_and_linear_ms(
    quantization: str,
    dtype: torch.dtype,
    streams: list[int],
    context: int,
    threads: int,
    lm_head: str = "auto",
) -> tuple[int, dict[int, float], int]:
    """(weight bytes per step, {streams: linear-layers ms}, KV bytes per token of context)."""
    from pd.worker.checkpoint.default_model import default_model_path
    from pd.worker.checkpoint.loader import load_checkpoint
    from pd.worker.model.quant import holds_int4
    from pd.worker.model.runner import ModelRunner
    from pd.worker.model.runner_config import RunnerConfig
    from pd.worker.model.smooth_quant import holds_smooth
    from pd.worker.model.tuning.calibration import activation_maxima

    torch.set_num_threads(threads)
    ckpt = load_checkpoint(
        default_model_path(), torch.float32, progress=False, keep_q4_1=holds_int4(quantization)
    )
    maxima = None
    if holds_smooth(quantization):
        maxima = activation_maxima(ckpt.config, ckpt.weights, ckpt.tokenizer.encode)
    rc = RunnerConfig(
        tp=1, dtype=dtype, device="cpu", num_pages=4, page_size=16,
        max_model_len=context + 16, quantization=quantization, lm_head_quantization=lm_head,
    )  # fmt: skip
    runner = ModelRunner(ckpt.config, ckpt.weights, rc, maxima)
    model = runner.model
    layers = model.ranks[0].layers
    cfg = ckpt.config
    weight_bytes = sum(layer.nbytes for layer in layers) + model.lm_head.nbytes
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    linear_ms = {}
    with torch.inference_mode():
        for n in streams:
            h = torch.randn(n, cfg.hidden_size, dtype=dtype)
            o = torch.randn(n, cfg.num_heads * cfg.head_dim, dtype=dtype)
            m = torch.randn(n, cfg.intermediate_size, dtype=dtype)

            def step(h: torch.Tensor, o: torch.Tensor, m: torch.Tensor) -> None:
                linear_layers(model, h, o, m)

            step(h, o, m)
            times = []
            for _ in range(7):
                t = time.perf_counter()
                step(h, o, m)
                times.append(time.perf_counter() - t)
            linear_ms[n] = 1000 * statistics.median(times)
    return weight_bytes, linear_ms, kv_per_token


async def one_stream(
    http: aiohttp.ClientSession,
    url: str,
    max_tokens: int,
    i: int,
    constrained: bool = False,
    no_eos: dict | None = None,
) -> list[float]:
    """One streamed completion; the time of each SSE chunk. `no_eos`: what replaces pd's
    `ignore_eos` in the body (llama.cpp's logit bias; None: pd's worker)."""
    body = {
        "prompt": f"Request {i}: write a long story about the number {i}.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **({"ignore_eos": True} if no_eos is None else no_eos),
    }
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "story", "schema": STORY_SCHEMA},
        }
    times = []
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times


async def measure(
    url: str, n: int, max_tokens: int, constrained: bool = False, no_eos: dict | None = None
) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        t0 = time.perf_counter()
        streams = await asyncio.gather(
            *(one_stream(http, url, max_tokens, i, constrained, no_eos) for i in range(n))
        )
    first = min(s[0] for s in streams)
    last = max(s[-1] for s in streams)
    decode_tokens = sum(len(s) - 1 for s in streams)
    return {
        "concurrency": n,
        "decode_tok_s": decode_tokens / (last - first),
        "mean_ttft_s": sum(s[0] - t0 for s in streams) / n,
        "mean_itl_ms": 1000 * sum((s[-1] - s[0]) / (len(s) - 1) for s in streams) / n,
        "wall_s": last - t0,
    }


def prefill_prompts(tokens: int, count: int) -> list[str]:
    """`count` prompts of about `tokens` tokens: the shipped perplexity text repeated, each
    after its own first line (so no prompt shares a prefix with another)."""
    from pd.worker.checkpoint import default_model_path, load_tokenizer
    from pd.worker.model.tuning.perplexity import shipped_text

    tok = load_tokenizer(default_model_path())
    text = shipped_text()
    ids = tok.encode(text)
    body = tok.decode((ids * (tokens // len(ids) + 1))[: max(tokens - 12, 1)])
    return [f"Document {k} of {count}, read it whole.\n{body}" for k in range(count)]


async def measure_prefill(url: str, prompts: list[str]) -> dict:
    """Each prompt with `max_tokens=1` in turn (the first a warm-up): the median prompt
    tokens/s, prompt tokens from the answer's `usage`."""
    rates, tokens = [], 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        for k, prompt in enumerate(prompts):
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
            t = time.perf_counter()
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                out = await resp.json()
            wall = time.perf_counter() - t
            tokens = out["usage"]["prompt_tokens"]
            if k:
                rates.append(tokens / wall)
    return {"prompt_tokens": tokens, "prefill_tok_s": statistics.median(rates)}


@dataclass(frozen=True)
class Config:
    """A worker's `--dtype`, `--quantization` (either may be `auto`) and
    `--lm-head-quantization` (auto: measured with the layers, or the layers' rule)."""

    dtype: str
    quantization: str
    head: str = "auto"

    @property
    def name(self) -> str:
        if self.is_default:
            return "auto"
        return f"{self.dtype}/{self.quantization}" + (
            "" if self.head == "auto" else f"/{self.head}"
        )

    @property
    def is_default(self) -> bool:
        return self.dtype == "auto" and self.quantization == "auto"


def parse_configs(text: str, formats: list[str]) -> list[Config]:
    """`--configs`: `auto`, `DTYPE/QUANTIZATION[/LM_HEAD]` entries, or `all` (auto and every
    dtype with every weight format this machine runs, `formats`)."""
    from pd.config import quantization_error
    from pd.worker.model.tuning.autotune import DTYPES

    if text == "all":
        return [Config("auto", "auto")] + [Config(d, q) for d in DTYPES for q in formats]
    out = []
    for entry in text.split(","):
        dtype, _, rest = entry.strip().partition("/")
        q, _, head = rest.partition("/")
        c = (
            Config("auto", "auto")
            if dtype == "auto" and not rest
            else Config(dtype, q or "auto", head or "auto")
        )
        why = "" if c.quantization == "auto" else quantization_error(c.quantization)
        if c.head != "auto":
            why = why or quantization_error(c.head, "--lm-head-quantization")
        if c.dtype not in (*DTYPES, "auto") or why:
            raise SystemExit(
                f"--configs: {entry!r} is not auto or DTYPE/QUANTIZATION[/LM_HEAD] (dtype one of "
                f"{', '.join(DTYPES)}; {why or 'quantization as --quantization takes it'})"
            )
        out.append(c)
    return out


def start_worker(args: argparse.Namespace, config: Config) -> tuple[subprocess.Popen, str]:
    """A `pd-worker --role both` in `config`, and its URL once ready; how long that took is
    `READY_S[url]` (a cold start: the kernel search, with an empty cache directory)."""
    t0 = time.perf_counter()
    cmd = [
        sys.executable, "-m", "pd.worker.main", "--role", "both", "--port", "0",
        "--dtype", config.dtype, "--quantization", config.quantization,
        "--lm-head-quantization", config.head,
        "--threads", str(args.threads), *args.worker_args.split(),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None  # stdout=PIPE
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-5:]
        if not args.json:
            print("  worker:", line.rstrip(), file=sys.stderr)
        if line.startswith("pd-worker ready:"):
            # keep reading what it logs after (a full pipe would block the worker)
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            url = line.split("url=")[1].strip()
            READY_S[url] = time.perf_counter() - t0
            return proc, url
    proc.wait()
    raise RuntimeError("the worker exited before it was ready: " + " | ".join(tail))


READY_S: dict[str, float] = {}  # a started worker's URL -> seconds from its start to ready
FIRST_STREAM_TOKENS = 64  # the stream timed at once after ready (issue 40, item 6)


def stop_workers(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each, then each waited for; killed after a minute."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# Longest wait for a started worker's one-row step to compile (minutes on a cold inductor cache).
COMPILE_WAIT_S = 1800.0
PENDING = ("compiling", "waiting for an idle moment")  # one_row.py's states before the last


def kernels_of(url: str) -> dict:
    """The worker's /health `kernels`: what it runs and, for auto, the figures that chose it;
    with its one-row step's background compile (`one_row_compile`)."""
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        health = orjson.loads(r.read())
    kernels: dict = health["kernels"]
    return {**kernels, "one_row_compile": health.get("one_row_compile", {"state": "off"})}


def wait_for_background_compile(url: str, timeout_s: float = COMPILE_WAIT_S) -> None:
    """Until the worker's one-row step is no longer compiling (one_row.py): the figures are
    the default's steady state, not its first minutes."""
    deadline = time.monotonic() + timeout_s
    while kernels_of(url)["one_row_compile"]["state"] in PENDING:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker's one-row step still compiles after {timeout_s} s")
        time.sleep(1.0)


def measure_worker(
    args: argparse.Namespace, config: Config, levels: list[int], prompts: list[str]
) -> dict:
    """The worker's resolved kernels, decode at each stream count, and prefill."""
    proc = None
    url = args.url
    if url is None:
        proc, url = start_worker(args, config)
    try:
        # a greedy stream at once after ready, before any warm-up: what a first user gets
        first = asyncio.run(measure(url, 1, FIRST_STREAM_TOKENS))["decode_tok_s"]
        wait_for_background_compile(url)
        kernels = kernels_of(url)
        asyncio.run(measure(url, 2, 8, args.constrained))  # warm-up (and the grammar compiled)
        out = []
        for n in levels:  # constrained and not, side by side at each stream count
            out.append(asyncio.run(measure(url, n, args.max_tokens)))
            if args.constrained:
                r = asyncio.run(measure(url, n, args.max_tokens, constrained=True))
                out[-1]["constrained_tok_s"] = r["decode_tok_s"]
        prefill = asyncio.run(measure_prefill(url, prompts)) if prompts else None
        warm = asyncio.run(measure(url, 1, FIRST_STREAM_TOKENS))["decode_tok_s"]
        start = {
            "ready_s": READY_S.get(url),  # None: a running worker (--url)
            "first_stream_tok_s": first,
            "warm_stream_tok_s": warm,
        }
        return {"kernels": kernels, "decode": out, "prefill": prefill, "start": start}
    finally:
        if proc:
            stop_workers([proc])


def _llama_cpp_model() -> tuple[str, dict]:
    """The GGUF llama.cpp serves (pd's default model) and the body part that bans its EOS ids
    (what pd's `ignore_eos` does)."""
    from pd.bench import llama_cpp
    from pd.worker.checkpoint import default_model_path, load_tokenizer

    model = default_model_path()
    return model, llama_cpp.decode_body(load_tokenizer(model).eos_token_ids)


def measure_llama_cpp(args: argparse.Namespace, threads: int, prompts: list[str]) -> dict:
    """llama.cpp's server on the same GGUF and threads: decode at one stream, and prefill; or
    why it did not run."""
    from pd.bench import llama_cpp

    why = llama_cpp.unavailable()
    if why:
        return {"skipped": why}
    model, no_eos = _llama_cpp_model()
    with llama_cpp.LlamaCppServer(model, threads) as server:
        asyncio.run(measure(server.url, 1, 8, no_eos=no_eos))  # warm-up
        runs = [asyncio.run(measure(server.url, 1, args.max_tokens, no_eos=no_eos))]
        runs.append(asyncio.run(measure(server.url, 1, args.max_tokens, no_eos=no_eos)))
        prefill = asyncio.run(measure_prefill(server.url, prompts)) if prompts else None
    best = max(runs, key=lambda r: r["decode_tok_s"])
    return {
        "version": llama_cpp.version(),
        "system_info": llama_cpp.system_info(),
        "gguf": os.path.basename(model),
        "tok_s_1_stream": round(best["decode_tok_s"], 1),
        "itl_ms": round(best["mean_itl_ms"], 2),
        "prefill_tok_s": None if prefill is None else round(prefill["prefill_tok_s"], 1),
        "prompt_tokens": None if prefill is None else prefill["prompt_tokens"],
    }


def perplexity_ratios(configs: list[Config], threads: int) -> dict[str, float]:
    """Each explicit configuration's perplexity on the shipped text over fp32 dense's (the
    bound `auto` keeps to: knobs.PPL_BOUND)."""
    from pd.worker.checkpoint import default_model_path, load_tokenizer
    from pd.worker.checkpoint.loader import load_checkpoint
    from pd.worker.model.tuning.autotune import Candidate
    from pd.worker.model.tuning.kernel_search import PerplexityJudge
    from pd.worker.model.tuning.perplexity import shipped_text

    torch.set_num_threads(threads)
    path = default_model_path()
    ckpt = load_checkpoint(path, torch.float32, progress=False, keep_q4_1=True)
    encode = load_tokenizer(path).encode
    judge = PerplexityJudge(ckpt.config, ckpt.weights, encode(shipped_text()), 1, 32, encode)
    return {
        c.name: judge.ratio(Candidate(c.dtype, c.quantization))
        if c.head == "auto"
        else judge.head_ratio(Candidate(c.dtype, c.quantization), Candidate(c.dtype, c.head))
        for c in configs
    }


def targets(
    runs: list[dict],
    prefill: dict[str, float],
    llama: dict,
    ppl: dict,
    duel: dict | None = None,
    duels: dict[int, dict] | None = None,
) -> dict:
    """The issue's ratios from this run: the default against llama.cpp, and against the best
    explicit configuration within the quality bound at 1 and 32 streams. With a head-to-head
    (`head_to_head`), the 1-stream ratio is its medians'; `..._separately` keeps the ratio of
    each server's own measurement. Likewise against the best explicit configuration: where
    `duels` (`default_against_best`) measured the default in turns with that one, the ratio of
    those medians, the separate one beside it."""
    duels = duels or {}
    from pd.worker.model.tuning.knobs import PPL_BOUND

    rate = {(r["config"], r["streams"]): r["tok_s"] for r in runs}
    out: dict = {}
    for n in sorted({r["streams"] for r in runs}):
        explicit = {
            r["config"]: r["tok_s"]
            for r in runs
            if r["streams"] == n and r["config"] != "auto" and ppl.get(r["config"], 9) <= PPL_BOUND
        }
        if ("auto", n) in rate and explicit:
            best = max(explicit, key=explicit.__getitem__)
            separately = round(rate["auto", n] / explicit[best], 3)
            out[f"default_over_best_{n}"] = (
                {"best": best, "ratio": duels[n]["ratio"], "separately": separately}
                if duels.get(n, {}).get("best") == best and "ratio" in duels[n]
                else {"best": best, "ratio": separately}
            )
    one = llama.get("tok_s_1_stream")
    if one:
        for n in (1, 32):
            if ("auto", n) in rate:
                out[f"default_{n}_over_llama_cpp_1"] = round(rate["auto", n] / one, 3)
        if duel and "ratio" in duel:
            if "default_1_over_llama_cpp_1" in out:
                out["default_1_over_llama_cpp_1_separately"] = out["default_1_over_llama_cpp_1"]
            out["default_1_over_llama_cpp_1"] = duel["ratio"]
        if llama.get("prefill_tok_s") and "auto" in prefill:
            out["default_prefill_over_llama_cpp"] = round(
                prefill["auto"] / llama["prefill_tok_s"], 3
            )
    return out


HEAD_TO_HEAD_ROUNDS = 5


def head_to_head(args: argparse.Namespace, threads: int, rounds: int = HEAD_TO_HEAD_ROUNDS) -> dict:
    """The default worker and llama.cpp's server up at once, one stream on each in turns, `rounds`
    times: the 1-stream target from the medians. On a machine with noisy neighbours (one stream of
    the same worker moved widely from minute to minute: docs/BENCHMARKS.md, "Fourth session, a noisy
    machine") a figure from each server's own minutes compares the noise; turns a few seconds apart
    see the same machine. An idle server takes no CPU from the other (both wait on sockets)."""
    from pd.bench import llama_cpp

    why = llama_cpp.unavailable()
    if why:
        return {"skipped": why}
    model, no_eos = _llama_cpp_model()
    proc, url = start_worker(args, Config("auto", "auto"))
    try:
        wait_for_background_compile(url)
        compiled = kernels_of(url)["one_row_compile"]
        with llama_cpp.LlamaCppServer(model, threads) as server:
            ours: list[float] = []
            theirs: list[float] = []
            asyncio.run(measure(url, 1, 8))  # warm-ups
            asyncio.run(measure(server.url, 1, 8, no_eos=no_eos))
            for _ in range(rounds):
                ours.append(asyncio.run(measure(url, 1, args.max_tokens))["decode_tok_s"])
                r = asyncio.run(measure(server.url, 1, args.max_tokens, no_eos=no_eos))
                theirs.append(r["decode_tok_s"])
    finally:
        stop_workers([proc])
    pd_median, llama_median = statistics.median(ours), statistics.median(theirs)
    return {
        "rounds": rounds,
        "pd_tok_s": [round(x, 1) for x in ours],
        "llama_cpp_tok_s": [round(x, 1) for x in theirs],
        "pd_median": round(pd_median, 1),
        "llama_cpp_median": round(llama_median, 1),
        "ratio": round(pd_median / llama_median, 3),
        "one_row_compile": compiled,
    }


DUEL_ROUNDS = 3


def fastest_explicit(runs: list[dict], levels: list[int]) -> dict[int, str]:
    """Streams -> the explicit configuration with the most tok/s at that many streams (the
    default measured there too)."""
    out = {}
    for n in levels:
        rates = {r["config"]: r["tok_s"] for r in runs if r["streams"] == n}
        explicit = {c: t for c, t in rates.items() if c != "auto"}
        if "auto" in rates and explicit:
            out[n] = max(explicit, key=explicit.__getitem__)
    return out


def default_against_best(
    args: argparse.Namespace,
    configs: dict[str, Config],
    best: dict[int, str],
    rounds: int = DUEL_ROUNDS,
) -> dict[int, dict]:
    """The default and the fastest explicit configuration at each level (`best`), both servers
    up at once and measured in turns `rounds` times, as `head_to_head`: measured each in its
    own minutes, the same kernels compared by the machine's drift (under the AVX2 cap auto ran
    behind float32/onednn-fp32 at 32 streams in three runs, though its 32-row step holds
    onednn-fp32's layers and timed the same in process: docs/EXPERIMENTS.md §13, "The benchmark
    compared the machine's drift too"). Streams -> the rival, both sides' tok/s and the ratio
    of the medians."""
    out: dict[int, dict] = {}
    for rival in dict.fromkeys(best.values()):
        levels = [n for n, c in best.items() if c == rival]
        procs = []
        got: dict[int, tuple[list[float], list[float]]] = {}
        try:
            procs.append(start_worker(args, Config("auto", "auto")))
            procs.append(start_worker(args, configs[rival]))
            (_, ours), (_, theirs) = procs
            wait_for_background_compile(ours)
            for url in (ours, theirs):  # warm-ups
                for n in levels:
                    asyncio.run(measure(url, n, 8))
            got = {n: ([], []) for n in levels}
            for _ in range(rounds):
                for n in levels:
                    got[n][0].append(asyncio.run(measure(ours, n, args.max_tokens))["decode_tok_s"])
                    got[n][1].append(
                        asyncio.run(measure(theirs, n, args.max_tokens))["decode_tok_s"]
                    )
        except RuntimeError as e:  # a worker that did not start: the separate figures stand
            out.update({n: {"best": rival, "skipped": str(e)} for n in levels})
            continue
        finally:
            stop_workers([proc for proc, _ in procs])
        for n, (a, b) in got.items():
            out[n] = {
                "best": rival,
                "default_tok_s": [round(x, 1) for x in a],
                "best_tok_s": [round(x, 1) for x in b],
                "ratio": round(statistics.median(a) / statistics.median(b), 3),
            }
    return out


def run(args: argparse.Namespace) -> int:
    from pd.worker.checkpoint import default_model_path
    from pd.worker.checkpoint.loader import load_checkpoint
    from pd.worker.model.tuning.cpu_info import read_cpu_info
    from pd.worker.model.tuning.kernel_search import formats_here

    cpu = read_cpu_info()
    threads = args.threads or os.cpu_count() or 1
    levels = [int(n) for n in args.concurrency.split(",")]
    if args.configs:
        formats = formats_here(load_checkpoint(default_model_path(), progress=False).config, 1, 32)
        configs = parse_configs(args.configs, formats)
    else:
        configs = parse_configs(
            ",".join(f"{args.dtype}/{q}" for q in args.quantizations.split(",")), []
        )
    prompts = prefill_prompts(args.prefill_tokens, 4) if args.prefill_tokens else []
    context = PROMPT_TOKENS + args.max_tokens // 2  # each stream's mean context while decoding
    # First every server (llama.cpp before and after pd's, the faster compared), with this
    # process only their client: torch's work in the client process (a 1 GiB read with 2
    # threads) made the llama.cpp server it started next several times slower
    # (docs/EXPERIMENTS.md §23), so the in-process figures (bandwidth, bytes, linear ms,
    # perplexity) come after.
    before = measure_llama_cpp(args, threads, prompts) if args.compare_llama_cpp else {}
    served, refused = {}, {}
    for c in configs:
        try:
            served[c.name] = measure_worker(args, c, levels, prompts)
        except RuntimeError as e:  # e.g. a format this CPU's torch refuses
            refused[c.name] = str(e)
    llama_runs = [before, measure_llama_cpp(args, threads, prompts)] if before else []
    duel = (
        head_to_head(args, threads)
        if args.compare_llama_cpp and args.url is None and "skipped" not in before
        else {}
    )
    llama = max(llama_runs, key=lambda r: r.get("tok_s_1_stream") or 0) if llama_runs else {}
    served_runs = [
        {"config": name, "streams": r["concurrency"], "tok_s": r["decode_tok_s"]}
        for name, got in served.items()
        for r in got["decode"]
    ]
    # the within-10% target needs the perplexities (--quality) to name the best configuration
    rivals = fastest_explicit(served_runs, levels) if args.url is None and args.quality else {}
    duels = default_against_best(args, {c.name: c for c in configs}, rivals) if rivals else {}
    gbps = read_gbps(threads)
    runs, prefill, kernels, prompt_tokens = [], {}, {}, 0
    for name, got in served.items():
        k = got["kernels"]
        kernels[name] = k
        dtype = torch.float32 if k["dtype"] == "float32" else torch.bfloat16
        weight_bytes, linear_ms, kv_per_token = step_bytes_and_linear_ms(
            k["quantization"], dtype, levels, context, threads, k["lm_head"]["runs"]
        )
        if got["prefill"]:
            prefill[name] = round(got["prefill"]["prefill_tok_s"], 1)
            prompt_tokens = got["prefill"]["prompt_tokens"]
        for r in got["decode"]:
            n = r["concurrency"]
            step_bytes = weight_bytes + n * context * kv_per_token
            bound = n * gbps * 1e9 / step_bytes
            if "constrained_tok_s" in r:
                extra = {
                    "constrained_tok_s": round(r["constrained_tok_s"], 1),
                    "constrained_ratio": round(r["constrained_tok_s"] / r["decode_tok_s"], 3),
                }
            else:
                extra = {}
            runs.append(
                {
                    **extra,
                    "config": name,
                    "dtype": k["dtype"],
                    "quantization": k["quantization"],
                    "streams": n,
                    "tok_s": round(r["decode_tok_s"], 1),
                    "step_ms": round(1000 * n / r["decode_tok_s"], 2),
                    "linear_ms": round(linear_ms[n], 2),
                    "bound_tok_s": round(bound, 1),
                    "share_of_bound": round(r["decode_tok_s"] / bound, 3),
                    "step_mb": round(step_bytes / 1e6, 1),
                    "itl_ms": round(r["mean_itl_ms"], 2),
                }
            )
    mark_slower_than_none(runs)
    explicit = [c for c in configs if not c.is_default and c.name in kernels]
    ppl = perplexity_ratios(explicit, threads) if args.quality else {}
    summary: dict = {
        "cpu": cpu.as_dict(),
        "cpu_line": cpu.describe(),
        "read_gbps": round(gbps, 2),
        "threads": threads,
        "runs": runs,
        "prefill_tok_s": prefill,
        "prompt_tokens": prompt_tokens,
        "kernels": {
            n: {
                "dtype": k["dtype"],
                "quantization": k["quantization"],
                "lm_head": k["lm_head"]["runs"],
                "how": k["how"],
            }
            for n, k in kernels.items()
        },
        "auto_search": kernels.get("auto"),  # what auto measured (or read from its cache)
        # from start to ready, and a 64-token stream at once after against one once warm
        "start": {
            name: {
                "ready_s": None if st["ready_s"] is None else round(st["ready_s"], 1),
                "first_stream_tok_s": round(st["first_stream_tok_s"], 1),
                "warm_stream_tok_s": round(st["warm_stream_tok_s"], 1),
                "first_over_warm": round(st["first_stream_tok_s"] / st["warm_stream_tok_s"], 3),
            }
            for name, got in served.items()
            for st in [got["start"]]
        },
        "perplexity_ratio": {n: round(p, 4) for n, p in ppl.items()},
        "refused": refused,
    }
    if args.compare_llama_cpp:
        summary["llama_cpp"] = llama
        summary["llama_cpp_runs"] = [r.get("tok_s_1_stream") for r in llama_runs or [before]]
        summary["head_to_head"] = duel
    summary["default_against_best"] = {str(n): d for n, d in duels.items()}
    summary["targets"] = targets(runs, prefill, llama, ppl, duel, duels) if ppl or llama else {}
    if args.constrained:
        summary["grammar"] = grammar_costs()
    if args.json:
        print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
        return 0
    print_summary(summary)
    return 0


def print_summary(summary: dict) -> None:
    print(f"CPU: {summary['cpu_line']}")
    print(f"read bandwidth {summary['read_gbps']:.1f} GB/s with {summary['threads']} threads")
    for name, k in summary["kernels"].items():
        if name == "auto":
            print(f"auto ran {k['dtype']}/{k['quantization']} ({k['how']})")
    for name, st in summary["start"].items():
        ready = "" if st["ready_s"] is None else f"ready {st['ready_s']:.1f} s after its start; "
        print(
            f"{name}: {ready}a {FIRST_STREAM_TOKENS}-token stream at once "
            f"{st['first_stream_tok_s']:.1f} tok/s, once warm {st['warm_stream_tok_s']:.1f} "
            f"({st['first_over_warm']:.2f}x)"
        )
    print(
        "                     config  streams    tok/s  step ms  linear ms  step MB  bound tok/s  share"
    )
    for r in summary["runs"]:
        print(
            f"{r['config']:>27} {r['streams']:>8} {r['tok_s']:>8.1f} {r['step_ms']:>8.1f} "
            f"{r['linear_ms']:>10.1f} {r['step_mb']:>8.1f} {r['bound_tok_s']:>12.1f} "
            f"{r['share_of_bound']:>6.2f}"
            + ("   SLOWER than none here" if r.get("slower_than_none") else "")
            + (
                f"   constrained {r['constrained_tok_s']:.1f} tok/s ({r['constrained_ratio']:.2f}x)"
                if "constrained_tok_s" in r
                else ""
            )
        )
    for name, rate in summary["prefill_tok_s"].items():
        print(f"prefill of {summary['prompt_tokens']} tokens, {name}: {rate:.1f} tok/s")
    for name, p in summary["perplexity_ratio"].items():
        print(f"perplexity over fp32's, {name}: {p:.4f}")
    for name, why in summary["refused"].items():
        print(f"{name}: not run ({why})")
    if "llama_cpp" in summary:
        lc = summary["llama_cpp"]
        if "skipped" in lc:
            print(f"llama.cpp: skipped, {lc['skipped']}")
        else:
            print(
                f"llama.cpp {lc['version']} ({lc['gguf']}): {lc['tok_s_1_stream']:.1f} tok/s at one "
                f"stream, prefill {lc['prefill_tok_s']} tok/s ({lc['prompt_tokens']} tokens)"
            )
    duel = summary.get("head_to_head") or {}
    if "ratio" in duel:
        print(
            f"head to head, one stream in turns x{duel['rounds']}: pd default "
            f"{duel['pd_tok_s']} (median {duel['pd_median']}), llama.cpp "
            f"{duel['llama_cpp_tok_s']} (median {duel['llama_cpp_median']}): {duel['ratio']}x"
        )
    for n, d in summary.get("default_against_best", {}).items():
        if "skipped" in d:
            print(f"default against {d['best']} at {n} streams: not run ({d['skipped']})")
            continue
        print(
            f"default against {d['best']} at {n} streams, in turns x{len(d['best_tok_s'])}: "
            f"{d['default_tok_s']} against {d['best_tok_s']}: {d['ratio']}x"
        )
    for name, v in summary["targets"].items():
        print(f"target {name}: {v}")
    if "grammar" in summary:
        g = summary["grammar"]
        print(
            f"grammar: compile {g['compile_cold_ms']} ms cold, {g['compile_cached_ms']} ms "
            f"cached; mask {g['mask_us_p50']} us a token (p50), {g['mask_us_max']} us max"
        )
