"""Plot `pd-bench routing --simulate` runs at several worker counts (docs/EXPERIMENTS.md section
7): routing decision time, the router's prefix index and P's prefill tokens against workers.

    python scripts/plot_router_scale.py OUT.png RUN.json [RUN.json ...]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out: str, paths: list[str]) -> None:
    by_setup: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["runs"]:
                if not r.get("refused"):
                    by_setup.setdefault(r["setup"], []).append(r)
    figures = (
        ("route_decision_mean_us", "routing decision, mean us"),
        ("prefix_index_blocks", "router's prefix index, blocks"),
        ("p_prefill_tokens", "tokens prefilled on P"),
    )
    fig, axes = plt.subplots(1, len(figures), figsize=(13, 3.6))
    for ax, (key, label) in zip(axes, figures, strict=True):
        for setup, runs in sorted(by_setup.items()):
            runs.sort(key=lambda r: r["workers"])
            ax.plot([r["workers"] for r in runs], [r[key] for r in runs], "o-", label=setup)
        ax.set_xlabel("simulated workers (3/4 P, 1/4 D)")
        ax.set_title(label)
        ax.set_xticks(sorted({r["workers"] for rs in by_setup.values() for r in rs}))
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
