"""`pd-bench kernels --step`: where a decode step's time goes beyond its linear layers. The worker's
model as its defaults build it on this CPU (`--dtype auto`, `--quantization none`), in process:
`rows` streams at a context of `CONTEXT` tokens each take one decode step (`LlamaModel.forward`:
embedding, norms, rotary, K/V write, paged attention, the LM head), and the same layer objects
run alone on a batch of `rows` (what `pd-bench engine` calls `linear_ms`), in turns, with the
probe's clock. What is left (`rest_ms`) is the step's non-linear work; sampling, scheduling and
HTTP are outside both (`pd-bench engine`'s `step_ms` has them)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

import torch

from pd.bench.engine import linear_layers
from pd.kvcache.paged_metadata import build_paged_metadata
from pd.worker.model.config import ModelConfig
from pd.worker.model.quant import Weight
from pd.worker.model.runner import ModelRunner
from pd.worker.model.runner_config import RunnerConfig

CONTEXT = 80  # tokens per stream: about pd-bench engine's mean (16 of prompt + 64 of 128 out)
PAGE = 16


def time_decode_step(
    config: ModelConfig,
    weights: Mapping[str, Weight],
    rows_list: Sequence[int],
    dtype: torch.dtype,
    clock: Callable[[], float],
    reps: int = 15,
) -> list[dict]:
    pages_per_seq = -(-(CONTEXT + 1) // PAGE)
    rc = RunnerConfig(
        tp=1, dtype=dtype, device="cpu",
        num_pages=max(rows_list) * pages_per_seq, page_size=PAGE, max_model_len=CONTEXT + PAGE,
    )  # fmt: skip
    runner = ModelRunner(config, weights, rc)
    with torch.inference_mode():
        return [_step(runner, config, r, pages_per_seq, dtype, clock, reps) for r in rows_list]


def _step(
    runner: ModelRunner,
    config: ModelConfig,
    rows: int,
    pages_per_seq: int,
    dtype: torch.dtype,
    clock: Callable[[], float],
    reps: int,
) -> dict:
    model = runner.model
    pages = [list(range(s * pages_per_seq, (s + 1) * pages_per_seq)) for s in range(rows)]
    for s, p in enumerate(pages):  # each stream's context, prefilled
        prompt = torch.tensor([(7 * i + s) % (config.vocab_size - 1) + 1 for i in range(CONTEXT)])
        model.forward(prompt, build_paged_metadata([(p, 0, CONTEXT)], PAGE), torch.tensor([0]))
    meta = build_paged_metadata([(p, CONTEXT, 1) for p in pages], PAGE)
    ids, sampled = torch.arange(rows) % (config.vocab_size - 1) + 1, torch.arange(rows)
    h = torch.randn(rows, config.hidden_size, dtype=dtype)
    o = torch.randn(rows, config.q_size, dtype=dtype)
    m = torch.randn(rows, config.intermediate_size, dtype=dtype)

    def forward() -> None:
        model.forward(ids, meta, sampled)

    def linear() -> None:
        linear_layers(model, h, o, m)

    times: dict[str, list[float]] = {"forward": [], "linear": []}
    forward()  # warm-up
    linear()
    for _ in range(reps):
        for name, fn in (("forward", forward), ("linear", linear)):
            t = clock()
            fn()
            times[name].append(clock() - t)
    fwd = 1000 * statistics.median(times["forward"])
    lin = 1000 * statistics.median(times["linear"])
    return {
        "rows": rows,
        "forward_ms": round(fwd, 2),
        "linear_ms": round(lin, 2),
        "rest_ms": round(fwd - lin, 2),
        "linear_share": round(lin / fwd, 3),
    }


def format_step(dtype: str, steps: Sequence[dict]) -> str:
    lines = [f"a decode step in process (--dtype {dtype}, context {CONTEXT}):"]
    for s in steps:
        lines.append(
            f"  rows={s['rows']}: forward {s['forward_ms']:.1f} ms, its linear layers alone "
            f"{s['linear_ms']:.1f} ms ({100 * s['linear_share']:.0f}%), the rest "
            f"{s['rest_ms']:.1f} ms"
        )
    return "\n".join(lines)
