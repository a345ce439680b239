"""`pd-bench sampling`: the sampler's time per step on a batch of logits shaped like a language
model's (Zipf-like: the r-th most likely token has logit -3.3 ln r, permuted per row), for
greedy, temperature, top-k, top-p, both, and min-p; median of `--repeats`, on a torch thread
with `--threads` (as the worker runs it)."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import orjson


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=64, help="rows (sampled requests) per step")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top_k_50": {"temperature": 0.8, "top_k": 50},
    "top_p_0.9": {"temperature": 0.8, "top_p": 0.9},
    "top_k_50_top_p_0.9": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "min_p_0.05": {"temperature": 0.8, "min_p": 0.05},
}


def measure(rows: int, vocab: int, repeats: int) -> dict[str, float]:
    import torch

    from pd.protocol import GenerationOptions
    from pd.worker.model.sampler import Sampler

    torch.manual_seed(0)
    base = -3.3 * torch.log(torch.arange(1, vocab + 1).float())
    logits = torch.stack([base[torch.randperm(vocab)] for _ in range(rows)])
    out = {}
    for name, kw in CASES.items():
        params = [GenerationOptions(**kw)] * rows
        prompts, outputs = [[1]] * rows, [[1]] * rows
        sampler = Sampler(0)
        for _ in range(3):
            sampler.sample(logits, params, prompts, outputs)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            sampler.sample(logits, params, prompts, outputs)
            times.append(time.perf_counter() - t)
        out[name] = round(1000 * statistics.median(times), 2)
    return out


def run(args: argparse.Namespace) -> int:
    from pd.worker.model.torch_thread import TorchThread

    threads = args.threads or os.cpu_count() or 1
    ms = TorchThread(threads).run(measure, args.rows, args.vocab, args.repeats)
    if args.json:
        print(orjson.dumps({"rows": args.rows, "vocab": args.vocab, "ms": ms}).decode())
    else:
        for name, v in ms.items():
            print(f"{name:>20}: {v:7.2f} ms per step of {args.rows} rows")
    return 0
