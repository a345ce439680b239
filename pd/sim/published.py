"""Published measurements of LLM serving on the GPUs the simulator models, as data: each
figure with its source's address, the words quoted, the conditions it was measured under and how
it maps onto the cost model (pd/sim/validation.py compares them; docs/simulation.md tabulates
them). No figure without its source; conversions are named where a figure is not a direct
measurement of one step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["itl_ms", "itl_intercept_ms", "itl_slope_ms", "ttft_ms", "output_tok_s"]


@dataclass(frozen=True)
class Source:
    key: str
    title: str
    url: str  # where the quoted words are; `read` names the exact file when it differs
    read: str = ""


@dataclass(frozen=True)
class Figure:
    source: str  # a key of SOURCES
    profile: str  # MODEL:DEVICE:tpN over the shipped presets
    kind: Kind
    published: float  # in the kind's unit (ms, ms per token of context, tokens/s)
    quote: str  # the source's words or table cells, exactly
    condition: str  # what was measured, in our words
    precision: Literal["bf16", "fp8"] = "bf16"
    batch: int = 1  # decode rows in flight (see `conversion` where it is estimated)
    input_len: int = 0
    output_len: int = 0
    input_to: int = 0  # the sweep's longest input (`itl_slope_ms` only)
    conversion: str = ""  # approximations made beyond the module doc's rule for the kind


_VLLM_FP8_KV = "vllm-fp8-kv"
_SGLANG_060 = "sglang-vllm-060"
_DATACRUNCH = "datacrunch-h200"
_NIM = "nim-benchmarking"

SOURCES: dict[str, Source] = {
    s.key: s
    for s in (
        Source(
            _VLLM_FP8_KV,
            "vLLM blog: The State of FP8 KV-Cache and Attention Quantization in vLLM (2026-04-22)",
            "https://blog.vllm.ai/2026/04/22/fp8-kvcache.html",
            "https://github.com/vllm-project/vllm-project.github.io/blob/"
            "5ffe2dd543a30f34309d71d8374803612223e9fb/_posts/2026-04-22-fp8-kvcache.md",
        ),
        Source(
            _SGLANG_060,
            "SGLang: How to reproduce the benchmark results for SGLang v0.3.0 compared to vLLM "
            "v0.6.0",
            "https://github.com/sgl-project/sglang/blob/120affb9613cc3f5bcd055ec09c7621d3ced0ebc/"
            "benchmark/benchmark_vllm_060/README.md",
        ),
        Source(
            _DATACRUNCH,
            "DataCrunch h200-benchmarks: SGLang online benchmark, Llama 70B on 4 x H200",
            "https://github.com/datacrunch-research/h200-benchmarks/blob/"
            "c091ef530a525d2e788bc41c39a4450b09c9f2ad/sglang/outputs/"
            "llama_3_3_70b_online_output.jsonl",
            "https://github.com/datacrunch-research/h200-benchmarks/blob/"
            "80368ba44a6bd5eba21059ee2b805166381b477d/sglang/README.md (hardware, TP)",
        ),
        Source(
            _NIM,
            "NVIDIA NIM LLMs Benchmarking: Performance (Llama-3.3-70b-instruct, NIM 1.8.0)",
            "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance",
        ),
    )
}

_H100_SWEEP = (
    "Llama-3.1-8B, one H100, vLLM (FlashAttention-3), BF16 KV cache, `vllm bench serve` at "
    "concurrency 1, 128 output tokens, inputs swept from 256 to 125k tokens, "
    "ITL = slope x input_len + intercept (of each quoted pair the first is BF16)"
)
_B200_SWEEP = (
    "Llama-3.1-8B, one B200, vLLM (FlashInfer), BF16 KV cache; the post states the sweep once, "
    "for Hopper (concurrency 1, 128 output tokens, inputs 256 to 125k): taken to be the same "
    "(of each quoted pair the first is BF16)"
)
_VLLM_LOAD = (
    "Llama-3.1-8B, one H100, vLLM, BF16 KV cache, 150 requests at concurrency 8, ~20k input "
    "and ~2k output tokens each (+-15%)"
)
_VLLM_TABLE4 = (
    "Table 4: | Config | Median TTFT (ms) | Median ITL (ms) | Total duration (s) | "
    "Output tok/s | ... | BF16 | 763.6 | 15.18 | 672.6 | 450.3 |"
)
_SGLANG_RUN = (
    "Llama 3.1 70B Instruct, BF16, 4 x H100 80G, SGLang v0.3.0 `--tp 4 --disable-radix-cache`, "
    "`sglang.bench_serving --dataset-name sharegpt`"
)
_SGLANG_HEAD = (
    "### Llama 3.1 70B Instruct 4 x H100 80G | RPS | Num Prompts | Engine | Median E2E Latency | "
    "Median TTFT | Median TPOT | Median ITL |"
)
_SHAREGPT_LENGTHS = (
    "ShareGPT lengths from the same tool's ShareGPT runs at the same prompt counts (DataCrunch's "
    "jsonl, figures 13 and 14): {} input and {} output tokens a request"
)
_DC_RUN = (
    "Llama 3.x 70B Instruct (the file names 3.3, the README 3.1: one architecture), BF16, "
    "4 x H200 141GB, SGLang TP 4 (the README's TP for this box), `sglang.bench_serving`"
)
_NIM_RUN = "Llama-3.3-70b-instruct (Llama 3.1 70B's architecture), NIM 1.8.0, 2 x H100 80G, fp8 TP2"
_NIM_FP8 = (
    "FP8 weights: one byte a weight and a KV element (NIM's FP8 KV setting is not stated; at "
    "concurrency 1 the KV read is 1-2% of the step either way), FP8 peak 1979 TFLOP/s"
)


def _dc(rate: float, dataset: str, quote: str, batch: int, inp: int, out: int) -> Figure:
    return Figure(
        _DATACRUNCH,
        "llama-3.1-70b:h200:tp4",
        "itl_ms",
        float(quote.split('"median_itl_ms": ')[1].split(",")[0]),
        quote,
        f"{_DC_RUN}, {dataset}, request rate {rate:g}/s: median ITL",
        batch=batch,
        input_len=inp,
        output_len=out,
        conversion=(
            f"batch = rate x mean E2E latency = {batch} (Little's law); lengths = the run's "
            "total tokens / completed requests"
        ),
    )


FIGURES: tuple[Figure, ...] = (
    Figure(
        _VLLM_FP8_KV,
        "llama-3.1-8b:h100:tp1",
        "itl_intercept_ms",
        6.44,
        "The fitted ITL slope drops from `4.37e-05` to `2.37e-05` ms/token, while the intercept "
        "changes only from `6.44` to `6.58` ms.",
        _H100_SWEEP + ": the intercept",
    ),
    Figure(
        _VLLM_FP8_KV,
        "llama-3.1-8b:h100:tp1",
        "itl_slope_ms",
        4.37e-05,
        "The fitted ITL slope drops from `4.37e-05` to `2.37e-05` ms/token",
        _H100_SWEEP + ": the slope",
        input_len=256,
        input_to=125_000,
    ),
    Figure(
        _VLLM_FP8_KV,
        "llama-3.1-8b:b200:tp1",
        "itl_intercept_ms",
        3.93,
        "For Llama-3.1-8B on B200, the fitted ITL slope drops from `1.80e-05` to `9.72e-06` "
        "ms/token, while the intercept changes only from `3.93` to `3.96` ms.",
        _B200_SWEEP + ": the intercept",
    ),
    Figure(
        _VLLM_FP8_KV,
        "llama-3.1-8b:b200:tp1",
        "itl_slope_ms",
        1.80e-05,
        "For Llama-3.1-8B on B200, the fitted ITL slope drops from `1.80e-05` to `9.72e-06` "
        "ms/token",
        _B200_SWEEP + ": the slope",
        input_len=256,
        input_to=125_000,
    ),
    Figure(
        _VLLM_FP8_KV,
        "llama-3.1-8b:h100:tp1",
        "itl_ms",
        15.18,
        _VLLM_TABLE4,
        _VLLM_LOAD + ": median ITL",
        batch=8,
        input_len=20_000,
        output_len=2_000,
        conversion="all 8 requests decoding; a median ITL is a step without a prefill in it",
    ),
    Figure(
        _VLLM_FP8_KV,
        "llama-3.1-8b:h100:tp1",
        "ttft_ms",
        763.6,
        _VLLM_TABLE4,
        _VLLM_LOAD + ": median TTFT",
        batch=8,
        input_len=20_000,
        output_len=2_000,
        conversion=(
            "prefill alone; the measured TTFT also holds the 7 other requests' decode rows in "
            "the same steps (chunked prefill), so the model should be somewhat low"
        ),
    ),
    Figure(
        _VLLM_FP8_KV,
        "llama-3.1-8b:h100:tp1",
        "output_tok_s",
        450.3,
        _VLLM_TABLE4,
        _VLLM_LOAD + ": output tok/s",
        batch=8,
        input_len=20_000,
        output_len=2_000,
    ),
    Figure(
        _SGLANG_060,
        "llama-3.1-70b:h100:tp4",
        "itl_ms",
        21.67,
        _SGLANG_HEAD + " ... | 4 | 1200 | SGLang | 3005.24 | **53.94** | 25.03 | **21.67** |",
        _SGLANG_RUN + ", 1200 prompts at 4 requests/s: median ITL",
        batch=12,
        input_len=224,
        output_len=189,
        conversion=(
            "batch = 4/s x median E2E 3.005 s = 12 (Little's law on the median, the only one "
            "published; the mean is larger, but 70B at TP4 is weight-bound to ~100 rows so the "
            "step barely moves); " + _SHAREGPT_LENGTHS.format(224, 189)
        ),
    ),
    Figure(
        _SGLANG_060,
        "llama-3.1-70b:h100:tp4",
        "itl_ms",
        24.45,
        _SGLANG_HEAD + " ... | 8 | 2400 | SGLang | 4064.98 | **58.11** | 33.07 | **24.45** |",
        _SGLANG_RUN + ", 2400 prompts at 8 requests/s: median ITL",
        batch=33,
        input_len=225,
        output_len=192,
        conversion=(
            "batch = 8/s x median E2E 4.065 s = 33 (as above); "
            + _SHAREGPT_LENGTHS.format(225, 192)
        ),
    ),
    _dc(
        1.0,
        "random 1024/1024 (range ratio 0)",
        '"dataset_name": "random", "request_rate": 1.0, ... "total_input_tokens": 152612, '
        '"total_output_tokens": 160347, ... "mean_e2e_latency_ms": 7840.616212638561, ... '
        '"median_itl_ms": 13.638956006616354, ... "completed": 300',
        batch=8,
        inp=509,
        out=534,
    ),
    _dc(
        2.0,
        "random 1024/1024 (range ratio 0)",
        '"dataset_name": "random", "request_rate": 2.0, ... "total_input_tokens": 308748, '
        '"total_output_tokens": 308712, ... "mean_e2e_latency_ms": 8540.55180882259, ... '
        '"median_itl_ms": 14.830046566203237, ... "completed": 600',
        batch=17,
        inp=515,
        out=515,
    ),
    _dc(
        4.0,
        "random 1024/1024 (range ratio 0)",
        '"dataset_name": "random", "request_rate": 4.0, ... "total_input_tokens": 615860, '
        '"total_output_tokens": 607936, ... "mean_e2e_latency_ms": 12896.330808075727, ... '
        '"median_itl_ms": 19.419891061261296, ... "completed": 1200',
        batch=52,
        inp=513,
        out=507,
    ),
    _dc(
        4.0,
        "sharegpt",
        '"dataset_name": "sharegpt", "request_rate": 4.0, ... "total_input_tokens": 269081, '
        '"total_output_tokens": 226901, ... "mean_e2e_latency_ms": 3201.4825566502986, ... '
        '"median_itl_ms": 13.841505162417889, ... "completed": 1200',
        batch=13,
        inp=224,
        out=189,
    ),
    _dc(
        8.0,
        "sharegpt",
        '"dataset_name": "sharegpt", "request_rate": 8.0, ... "total_input_tokens": 540779, '
        '"total_output_tokens": 461874, ... "mean_e2e_latency_ms": 5302.550664339797, ... '
        '"median_itl_ms": 17.667690059170127, ... "completed": 2400',
        batch=42,
        inp=225,
        out=192,
    ),
    Figure(
        _NIM,
        "llama-3.1-70b:h100:tp2",
        "itl_ms",
        18.58,
        "5000 Input Tokens / 500 Output Tokens | Concurrency | TTFT (ms) | ITL (ms) | "
        "Throughput(Tokens/s) | ... | 1 | 406.77 | 18.58 | 51.67 |",
        _NIM_RUN + ", 5000 in / 500 out, concurrency 1: ITL",
        precision="fp8",
        input_len=5000,
        output_len=500,
        conversion=_NIM_FP8,
    ),
    Figure(
        _NIM,
        "llama-3.1-70b:h100:tp2",
        "ttft_ms",
        406.77,
        "5000 Input Tokens / 500 Output Tokens | Concurrency | TTFT (ms) | ITL (ms) | "
        "Throughput(Tokens/s) | ... | 1 | 406.77 | 18.58 | 51.67 |",
        _NIM_RUN + ", 5000 in / 500 out, concurrency 1: TTFT",
        precision="fp8",
        input_len=5000,
        output_len=500,
        conversion=_NIM_FP8 + "; TTFT measured at the client (HTTP and tokenization in it)",
    ),
    Figure(
        _NIM,
        "llama-3.1-70b:h100:tp2",
        "itl_ms",
        18.91,
        "500 Input Tokens / 2000 Output Tokens | Concurrency | TTFT (ms) | ITL (ms) | "
        "Throughput(Tokens/s) | ... | 1 | 47.77 | 18.91 | 52.85 |",
        _NIM_RUN + ", 500 in / 2000 out, concurrency 1: ITL",
        precision="fp8",
        input_len=500,
        output_len=2000,
        conversion=_NIM_FP8,
    ),
    Figure(
        _NIM,
        "llama-3.1-70b:h100:tp2",
        "ttft_ms",
        47.77,
        "500 Input Tokens / 2000 Output Tokens | Concurrency | TTFT (ms) | ITL (ms) | "
        "Throughput(Tokens/s) | ... | 1 | 47.77 | 18.91 | 52.85 |",
        _NIM_RUN + ", 500 in / 2000 out, concurrency 1: TTFT",
        precision="fp8",
        input_len=500,
        output_len=2000,
        conversion=_NIM_FP8 + "; TTFT measured at the client (HTTP and tokenization in it)",
    ),
)
