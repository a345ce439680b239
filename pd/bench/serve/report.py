"""What a run writes to `--output-dir`: a CSV of per-request records and PNG plots (TTFT and ITL
CDFs, goodput and p99 TTFT/TPOT against rate, one line per target)."""

from __future__ import annotations

import csv
import math
import os
from typing import Any

from pd.bench.serve.client import RequestRecord
from pd.bench.serve.metrics import percentile

CSV_FIELDS = (
    "target", "rate", "job_id", "turn", "planned_s", "sent_s", "lag_s", "ttft_s", "tpot_s",
    "e2e_s", "itl_p99_s", "prompt_tokens", "output_tokens", "cached_tokens", "error", "detail",
    "priority_class", "error_code",
)  # fmt: skip


def write_csv(path: str, records: list[RequestRecord]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in records:
            itl_p99 = percentile(r.itl_s, 99) if r.itl_s else None
            row = {**vars(r), "lag_s": r.lag_s, "tpot_s": r.tpot_s, "itl_p99_s": itl_p99}
            w.writerow(["" if row.get(k) is None else row[k] for k in CSV_FIELDS])


def write_plots(
    out_dir: str,
    records: list[RequestRecord],
    results: list[dict[str, Any]],
    cdf_rate: float | None = None,
) -> list[str]:
    """The PNGs; returns their paths. Needs matplotlib (the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    targets = sorted({r.target for r in records})
    rates = sorted({r.rate for r in records if r.rate is not None})
    # CDFs at one rate: `cdf_rate`, else the sweep's middle one.
    shown = cdf_rate if cdf_rate is not None else (rates[len(rates) // 2] if rates else None)
    for name, values in (
        ("ttft", lambda r: [r.ttft_s] if r.ttft_s is not None else []),
        ("itl", lambda r: r.itl_s),
    ):
        fig, ax = plt.subplots(figsize=(5, 3.4), dpi=110)
        for t in targets:
            xs = sorted(
                1000 * v for r in records if r.ok and r.target == t and r.rate == shown
                for v in values(r)
            )  # fmt: skip
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=t)
        where = f" at {shown:g} req/s" if shown is not None else ""
        ax.set(xlabel=f"{name.upper()} (ms)", ylabel="share of " + ("requests" if name == "ttft" else "gaps"),
               title=f"{name.upper()} CDF{where}")  # fmt: skip
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out_dir, f"{name}_cdf.png"))
        plt.close(fig)
    if len(rates) > 1:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), dpi=110)
        for t in targets:
            rows = sorted((r for r in results if r["target"] == t), key=lambda r: r["rate"])
            xs = [r["rate"] for r in rows]
            axes[0].plot(xs, [r["goodput_rps"] for r in rows], marker="o", label=t)
            axes[1].plot(xs, [_nan(r["ttft_ms"]["p99"]) for r in rows], marker="o", label=t)
            axes[2].plot(xs, [_nan(r["tpot_ms"]["p99"]) for r in rows], marker="o", label=t)
        for ax, title in zip(axes, ("goodput (req/s)", "TTFT p99 (ms)", "TPOT p99 (ms)")):
            ax.set(xlabel="request rate (req/s)", title=title)
            ax.grid(alpha=0.3)
            ax.legend()
        written.append(_save(fig, out_dir, "vs_rate.png"))
        plt.close(fig)
    return written


def _nan(v: float | None) -> float:
    return math.nan if v is None else v


def _save(fig: Any, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path)
    return path
