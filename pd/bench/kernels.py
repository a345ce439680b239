"""`pd-bench kernels`: every candidate linear kernel (`kernel_candidates.py`) timed on this CPU at
the default model's shapes, the probe of issue 24 that a worker's kernel chooser will be built on.

For each batch of `--decode-rows` (decode steps: that many streams) and `--prefill-rows` (a prefill
chunk) and each of the model's linear shapes (q/k/v, o, gate/up, down, and the LM head; read from
the checkpoint, with its real weights from `--layer`), every candidate is built from the fp32
weight and timed with `--threads` torch threads: a warm-up call (whose output gives the error
against fp32, on random inputs), then rounds in which each candidate runs once in turn, so a load
that comes and goes touches them all alike; the median of the rounds is its time (a candidate
whose warm-up took over a second is not repeated). A step's linear time is the sum over the
model's layers plus the LM head, which a prefill step applies to one row (each sequence's last);
rows over that time is the most tokens/s the step could reach if nothing else took time.
`kernel_report.py` sums and prints it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable, Sequence

import orjson
import torch

from pd.bench.kernel_candidates import BY_NAME, CANDIDATES, Candidate, Layer, rel_error, try_build
from pd.bench.kernel_report import Timing, build_report, format_report
from pd.bench.kernel_shapes import Shape, cells, model_shapes, shape_weights
from pd.worker.model.tuning.cpu_info import read_cpu_info

SLOW_S = 1.0  # a warm-up call longer than this is the candidate's one sample


# `--clock`: wall time, or the CPU time of the calling thread, which at --threads 1 is all the
# work and leaves out the time other processes held the core (a load-free figure on a busy box)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def _call_s(
    layer: Layer, x: torch.Tensor, clock: Callable[[], float]
) -> tuple[float, torch.Tensor]:
    t = clock()
    y = layer(x)
    return clock() - t, y


def time_cell(
    shape: Shape,
    rows: int,
    weight: torch.Tensor,
    candidates: Sequence[Candidate],
    budget_s: float,
    max_reps: int,
    clock: Callable[[], float] = time.perf_counter,
    seed: int = 0,
) -> list[Timing]:
    """Every candidate on one shape and batch, interleaved (module docstring)."""
    x = torch.randn(rows, shape.inp, generator=torch.Generator().manual_seed(seed))
    ref = torch.nn.functional.linear(x.double(), weight.double())
    built: list[tuple[Candidate, Layer, torch.Tensor, int]] = []
    out: dict[str, Timing] = {}
    with torch.inference_mode():
        for c in candidates:
            layer, why = try_build(c, weight, rows)
            if layer is None:
                out[c.name] = Timing(c.name, shape.name, rows, [], 0.0, 0.0, why)
                continue
            xc = x.to(c.act_dtype)
            first, y = _call_s(layer, xc, clock)
            abs_err, rel_err = rel_error(y, ref)
            samples = [first] if first > SLOW_S else []
            if not samples:
                first, _ = _call_s(layer, xc, clock)  # a second warm-up
            reps = 0 if samples else max(5, min(max_reps, int(budget_s / max(first, 1e-6))))
            out[c.name] = Timing(c.name, shape.name, rows, samples, abs_err, rel_err, "")
            built.append((c, layer, xc, reps))
        for r in range(max((reps for *_, reps in built), default=0)):
            for c, layer, xc, reps in built:
                if r < reps:
                    out[c.name].samples_s.append(_call_s(layer, xc, clock)[0])
    return [out[c.name] for c in candidates]


def drop_slow(
    timings: Sequence[Timing],
    active: Sequence[Candidate],
    shapes: Sequence[Shape],
    rows: int,
    factor: float,
) -> tuple[list[Candidate], dict[str, str]]:
    """(the candidates to time on prefill chunks, {dropped: why}): those whose layers at `rows`
    (the largest decode batch) took over `factor` times the fastest's (a kernel with no
    vectorized path for this dtype: timing it on prefill chunks would take minutes and tell
    nothing new). Every candidate is timed at every decode batch."""
    per_step = {s.name: s.per_step for s in shapes}
    ms = {}
    for c in active:
        ts = [t for t in timings if t.candidate == c.name and t.rows == rows and t.samples_s]
        if ts:
            ms[c.name] = sum(t.us * per_step[t.shape] for t in ts) / 1000
    if len(ms) < 2:
        return list(active), {}
    best = min(ms.values())
    slow = {n: m / best for n, m in ms.items() if m > factor * best}
    why = {n: f"prefill not timed: {x:.0f}x the fastest at rows={rows}" for n, x in slow.items()}
    return [c for c in active if c.name not in slow], why


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=2, help="torch threads (torch.set_num_threads)")
    p.add_argument("--decode-rows", default="1,8,32", help="decode batches (streams)")
    p.add_argument("--prefill-rows", default="512,1229", help="prefill chunks (tokens)")
    p.add_argument(
        "--candidates", default="", help=f"comma-separated subset of: {', '.join(BY_NAME)}"
    )
    p.add_argument("--model", default="", help="checkpoint (default: the embedded SmolLM2-135M)")
    p.add_argument("--layer", type=int, default=0, help="whose weights the layer shapes use")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or the calling thread's CPU time (load-free; needs --threads 1)",
    )
    p.add_argument("--budget-ms", type=float, default=300.0, help="time per candidate per cell")
    p.add_argument("--max-reps", type=int, default=40, help="most rounds per cell")
    p.add_argument(
        "--drop-x",
        type=float,
        default=10.0,
        help="skip prefill chunks for a candidate this much slower at the largest decode batch",
    )
    p.add_argument(
        "--step",
        action="store_true",
        help="also time a decode step's forward (the worker's default dtype) against its "
        "linear layers at each decode batch",
    )
    p.add_argument("--per-shape", action="store_true", help="also print us per call per shape")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def run(args: argparse.Namespace) -> int:
    from pd.bench.engine import read_gbps
    from pd.worker.checkpoint import default_model_path, load_checkpoint

    if args.clock == "cpu" and args.threads != 1:
        print(
            "--clock cpu counts the calling thread only: use it with --threads 1", file=sys.stderr
        )
        return 2
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.candidates.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"unknown candidates: {', '.join(unknown)}", file=sys.stderr)
        return 2
    candidates = [BY_NAME[n] for n in names] if names else list(CANDIDATES)
    cpu = read_cpu_info()
    load_before = os.getloadavg()
    ckpt = load_checkpoint(args.model or default_model_path(), torch.float32, progress=False)
    shapes = model_shapes(ckpt.config)
    weights = shape_weights(ckpt.weights, ckpt.config, args.layer)
    decode_rows, prefill_rows = _ints(args.decode_rows), _ints(args.prefill_rows)
    gbps = read_gbps(args.threads, gib=0.5)
    timings: list[Timing] = []
    skipped = {c.name: why for c in candidates if (why := c.skip_unless(cpu))}
    timed = [c for c in candidates if c.name not in skipped]
    t0 = time.perf_counter()
    active, dropped = timed, {}
    for rows, group in itertools.groupby(cells(shapes, decode_rows, prefill_rows), lambda c: c[1]):
        for shape, _ in group:
            if not args.json:
                print(f"  timing {shape.name} x {rows} rows ...", file=sys.stderr)
            timings += time_cell(
                shape,
                rows,
                weights[shape.name],
                active,
                args.budget_ms / 1000,
                args.max_reps,
                CLOCKS[args.clock],
            )
        if rows == max(decode_rows, default=0) and prefill_rows:
            active, slow = drop_slow(timings, active, shapes, rows, args.drop_x)
            dropped.update(slow)
    report = build_report(
        cpu=cpu,
        model=ckpt.config.name,
        shapes=shapes,
        candidates=timed,
        skipped=skipped,
        dropped=dropped,
        timings=timings,
        decode_rows=decode_rows,
        prefill_rows=prefill_rows,
        threads=args.threads,
        clock=args.clock,
        read_gbps=gbps,
        load=(load_before[0], os.getloadavg()[0]),
        wall_s=time.perf_counter() - t0,
    )
    if args.step:
        from pd.bench.kernel_step import time_decode_step
        from pd.worker.model.device import resolve_dtype

        dtype = resolve_dtype("auto", "cpu")
        report["step_dtype"] = str(dtype).removeprefix("torch.")
        report["step"] = time_decode_step(
            ckpt.config, ckpt.weights, decode_rows, dtype, CLOCKS[args.clock]
        )
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(format_report(report, per_shape=args.per_shape))
    if args.step:
        from pd.bench.kernel_step import format_step

        print(format_step(report["step_dtype"], report["step"]))
    return 0
