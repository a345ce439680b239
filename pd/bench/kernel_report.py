"""`pd-bench kernels`' figures: each candidate's time per step (the model's linear layers summed),
the tokens/s bound that implies, its error against fp32, the fastest candidate per batch, and
the best step a per-shape choice would reach; as a JSON-ready dict and as text."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from pd.bench.kernel_candidates import Candidate
from pd.bench.kernel_shapes import Shape, step_cells, step_weights
from pd.worker.model.tuning.cpu_info import CpuInfo


@dataclass
class Timing:
    """One candidate on one (shape, rows) cell."""

    candidate: str
    shape: str
    rows: int
    samples_s: list[float] = field(default_factory=list)
    abs_err: float = 0.0
    rel_err: float = 0.0
    error: str = ""  # why it did not run ("" if it did)

    @property
    def us(self) -> float:
        return 1e6 * statistics.median(self.samples_s)


def _step(
    by_cell: dict[tuple[str, str, int], Timing],
    c: Candidate,
    shapes: Sequence[Shape],
    rows: int,
    prefill: bool,
) -> dict | None:
    """One step's linear layers with candidate `c` (None where a cell did not run)."""
    parts = [by_cell.get((c.name, s.name, r)) for s, r in step_cells(shapes, rows, prefill)]
    if any(t is None or t.error or not t.samples_s for t in parts):
        return None
    ts = [t for t in parts if t is not None]
    ms = sum(t.us * s.per_step for t, s in zip(ts, shapes)) / 1000
    fastest_ms = sum(1e3 * min(t.samples_s) * s.per_step for t, s in zip(ts, shapes))
    err = max(t.rel_err for t in ts)
    return {
        "step_ms": round(ms, 3),
        "step_ms_min": round(fastest_ms, 3),  # each cell's fastest call: a load-free estimate
        "bound_tok_s": round(1000 * rows / ms, 1),
        # the weights' bytes over the step's time: how near the read bound a decode step runs
        "weights_gbps": round(step_weights(shapes) * c.weight_bits / 8 / ms / 1e6, 2),
        "max_rel_err": float(f"{err:.3g}"),
        "ok": err <= c.rel_tol,
    }


def _ran(timings: Sequence[Timing], c: Candidate) -> list[Timing]:
    return [t for t in timings if t.candidate == c.name and t.samples_s]


def _best(
    by_cell: dict[tuple[str, str, int], Timing],
    candidates: Sequence[Candidate],
    shapes: Sequence[Shape],
    rows: int,
    prefill: bool,
) -> dict | None:
    """The step if each shape took its fastest candidate among `candidates` (those within
    tolerance on every cell they ran: a kernel that saturates on some inputs is out)."""
    ms, picks = 0.0, {}
    for s, r in step_cells(shapes, rows, prefill):
        ok = [t for c in candidates if (t := by_cell.get((c.name, s.name, r))) and t.samples_s]
        if not ok:
            return None
        t = min(ok, key=lambda t: t.us)
        ms += t.us * s.per_step / 1000
        picks[s.name] = t.candidate
    return {"step_ms": round(ms, 3), "bound_tok_s": round(1000 * rows / ms, 1), "picks": picks}


def build_report(
    *,
    cpu: CpuInfo,
    model: str,
    shapes: Sequence[Shape],
    candidates: Sequence[Candidate],
    skipped: dict[str, str],
    dropped: dict[str, str],
    timings: Sequence[Timing],
    decode_rows: Sequence[int],
    prefill_rows: Sequence[int],
    threads: int,
    clock: str,
    read_gbps: float,
    load: tuple[float, float],
    wall_s: float,
) -> dict:
    by_cell = {(t.candidate, t.shape, t.rows): t for t in timings}
    batches = [(r, False) for r in decode_rows] + [(r, True) for r in prefill_rows]
    n_weights = step_weights(shapes)
    rows_out: list[dict] = []
    for c in candidates:
        errors = sorted({t.error for t in timings if t.candidate == c.name and t.error})
        rows_out.append(
            {
                "name": c.name,
                "act_dtype": str(c.act_dtype).removeprefix("torch."),
                "weights": c.weights,
                "op": c.op,
                "rel_tol": c.rel_tol,
                "pd_today": c.pd_today,
                "step_mb": round(n_weights * c.weight_bits / 8 / 1e6, 1),
                "read_bound_ms": round(n_weights * c.weight_bits / 8 / read_gbps / 1e6, 2),
                "unavailable": "; ".join(errors),
                "steps": {str(r): _step(by_cell, c, shapes, r, prefill) for r, prefill in batches},
            }
        )
    correct = [c for c in candidates if all(t.rel_err <= c.rel_tol for t in _ran(timings, c))]
    names = {c.name for c in correct}
    fastest = {}
    for r, _ in batches:
        ok = [(c["steps"][str(r)], c["name"]) for c in rows_out if c["name"] in names]
        ok = [(s["step_ms"], n) for s, n in ok if s]
        fastest[str(r)] = min(ok)[1] if ok else None
    wide = [c for c in correct if c.weight_bits >= 8]
    return {
        "cpu": cpu.as_dict(),
        "model": model,
        "threads": threads,
        "clock": clock,
        "read_gbps": round(read_gbps, 2),
        "load_1min": [round(x, 2) for x in load],
        "wall_s": round(wall_s, 1),
        "shapes": [
            {"name": s.name, "out": s.out, "in": s.inp, "per_step": s.per_step} for s in shapes
        ],
        "decode_rows": list(decode_rows),
        "prefill_rows": list(prefill_rows),
        "candidates": rows_out,
        "within_tolerance": [c.name for c in correct],
        "skipped": skipped,
        "dropped": dropped,
        "fastest": fastest,
        "best_per_shape": {
            "8bit_or_wider": {str(r): _best(by_cell, wide, shapes, r, p) for r, p in batches},
            "any": {str(r): _best(by_cell, correct, shapes, r, p) for r, p in batches},
        },
        "per_shape": [
            {
                "candidate": t.candidate,
                "shape": t.shape,
                "rows": t.rows,
                "us": round(t.us, 1) if t.samples_s else None,
                "us_min": round(1e6 * min(t.samples_s), 1) if t.samples_s else None,
                "n": len(t.samples_s),
                "abs_err": float(f"{t.abs_err:.3g}"),
                "rel_err": float(f"{t.rel_err:.3g}"),
                "error": t.error,
            }
            for t in timings
        ],
    }


def _cell(step: dict | None) -> str:
    if step is None:
        return "-"
    return f"{step['step_ms']:.1f} ({step['bound_tok_s']:.0f})" + ("" if step["ok"] else " !")


def format_report(r: dict, per_shape: bool = False) -> str:
    cpu = r["cpu"]
    flags = ", ".join(f"{f} {'yes' if ok else 'no'}" for f, ok in cpu["flags"].items())
    batches = [str(b) for b in r["decode_rows"] + r["prefill_rows"]]
    shapes = ", ".join(f"{s['name']} {s['out']}x{s['in']} (x{s['per_step']})" for s in r["shapes"])
    lines = [
        f"CPU: {cpu['model']} ({cpu['arch']}, {cpu['logical_cpus']} CPUs, kind {cpu['kind']}; "
        f"torch {cpu['torch_capability']}): {flags}",
        f"threads {r['threads']}, clock {r['clock']}, load (1 min) {r['load_1min'][0]} -> {r['load_1min'][1]}, "
        f"read bandwidth {r['read_gbps']} GB/s, {r['wall_s']} s",
        f"model {r['model']}: {shapes}",
        "",
        "linear layers per step, ms (bound tok/s = rows / that); prefill rows: "
        + ", ".join(map(str, r["prefill_rows"]))
        + "; ! = error over tolerance",
        f"{'candidate':<17}" + "".join(f"{'rows=' + b:>17}" for b in batches)
        + f"{'max err':>10}{'tol':>7}{'read ms':>9}  pd today",
    ]  # fmt: skip
    for c in r["candidates"]:
        if c["unavailable"] and not any(c["steps"].values()):
            lines.append(f"{c['name']:<17}  not on this CPU: {c['unavailable']}")
            continue
        errs = [s["max_rel_err"] for s in c["steps"].values() if s]
        lines.append(
            f"{c['name']:<17}"
            + "".join(f"{_cell(c['steps'][b]):>17}" for b in batches)
            + f"{max(errs, default=0):>10.2g}{c['rel_tol']:>7.2g}{c['read_bound_ms']:>9.1f}"
            + f"  {c['pd_today']}"
        )
    for name, why in r["skipped"].items():
        lines.append(f"{name:<17}  not timed: {why}")
    for name, why in r["dropped"].items():
        lines.append(f"{name:<17}  {why}")
    lines.append("")
    lines.append(
        "fastest of those within tolerance everywhere: "
        + ", ".join(f"{b}: {r['fastest'][b]}" for b in batches)
    )
    for label, best in r["best_per_shape"].items():
        cells = []
        for b in batches:
            s = best[b]
            cells.append(f"{b}: -" if s is None else f"{b}: {s['step_ms']:.1f} ms")
        lines.append(f"best per shape ({label}): " + ", ".join(cells))
        for b in batches:
            if best[b]:
                picks = ", ".join(f"{k} {v}" for k, v in best[b]["picks"].items())
                lines.append(f"    rows={b}: {picks}")
    if per_shape:
        lines += ["", "us per call (median of n; error against fp32):"]
        for t in r["per_shape"]:
            us = "-" if t["us"] is None else f"{t['us']:.0f}"
            lines.append(
                f"  {t['candidate']:<17}{t['shape']:<8}{t['rows']:>6}{us:>11}  n={t['n']:<3}"
                f" rel err {t['rel_err']:.2g}" + (f"  {t['error']}" if t["error"] else "")
            )
    return "\n".join(lines)
