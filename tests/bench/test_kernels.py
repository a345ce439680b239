"""`pd-bench kernels` (issue 24's probe): the shapes, the CPU flags, the report's sums, and that
every candidate kernel computes what fp32 computes within its stated tolerance (the check a
kernel chooser relies on), on tiny shapes."""

from __future__ import annotations

import argparse
import time

import pytest
import torch
import torch.nn.functional as F

from pd.bench import kernels
from pd.bench.cli import SUBCOMMANDS
from pd.bench.kernel_candidates import BY_NAME, CANDIDATES, Candidate, rel_error, try_build
from pd.bench.kernel_report import Timing, build_report, format_report
from pd.bench.kernel_shapes import Shape, cells, model_shapes, shape_weights, step_cells
from pd.bench.kernel_step import format_step, time_decode_step
from pd.worker.checkpoint.load_utils import expected_weight_shapes
from pd.worker.model.config import ModelConfig
from pd.worker.model.quant import Weight, quantize_groups
from pd.worker.model.tuning.cpu_info import CpuInfo, parse_cpuinfo, read_cpu_info

SMOLLM2 = ModelConfig(
    name="SmolLM2-135M-Instruct", architecture="llama", vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
    rope_theta=1e5, rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma f16c bmi2

processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma f16c bmi2 avx512f
"""

ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes sha2 crc32 asimddp sve i8mm bf16
CPU implementer\t: 0x41
"""


def test_model_shapes_are_the_steps_linear_layers():
    got = [(s.name, s.out, s.inp, s.per_step) for s in model_shapes(SMOLLM2)]
    assert got == [
        ("qkv", 960, 576, 30),
        ("o", 576, 576, 30),
        ("gate_up", 3072, 576, 30),
        ("down", 576, 1536, 30),
        ("lm_head", 49152, 576, 1),
    ]


def test_cells_time_the_head_only_where_a_step_applies_it():
    shapes = model_shapes(SMOLLM2)
    got = {(s.name, r) for s, r in cells(shapes, [1, 8], [512])}
    layers = {"qkv", "o", "gate_up", "down"}
    assert got == {(n, r) for n in layers for r in (1, 8, 512)} | {("lm_head", 1), ("lm_head", 8)}
    prefill_only = {(s.name, r) for s, r in cells(shapes, [], [64])}
    assert ("lm_head", 1) in prefill_only and ("lm_head", 64) not in prefill_only
    head = [r for s, r in step_cells(shapes, 512, prefill=True) if s.is_head]
    assert head == [1]
    assert [r for s, r in step_cells(shapes, 8, prefill=False) if s.is_head] == [8]


def test_shape_weights_fuse_as_the_model_does():
    cfg = ModelConfig(
        name="t", architecture="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=1e4,
        rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    p = "model.layers.0."
    w: dict[str, Weight] = {
        p + "self_attn.q_proj.weight": torch.full((32, 32), 1.0),
        p + "self_attn.k_proj.weight": torch.full((16, 32), 2.0),
        p + "self_attn.v_proj.weight": torch.full((16, 32), 3.0),
        p + "self_attn.o_proj.weight": torch.zeros(32, 32),
        p + "mlp.gate_proj.weight": quantize_groups(torch.ones(64, 32), 32),
        p + "mlp.up_proj.weight": torch.zeros(64, 32),
        p + "mlp.down_proj.weight": torch.zeros(32, 64),
        "model.embed_tokens.weight": torch.zeros(40, 32),
    }
    got = shape_weights(w, cfg, 0)
    assert {k: tuple(v.shape) for k, v in got.items()} == {
        s.name: (s.out, s.inp) for s in model_shapes(cfg)
    }
    assert got["qkv"][:, 0].tolist() == [1.0] * 32 + [2.0] * 16 + [3.0] * 16
    assert got["gate_up"].dtype == torch.float32 and got["gate_up"][0, 0] == 1.0


def test_parse_cpuinfo_x86_and_arm():
    model, flags = parse_cpuinfo(X86)
    assert model == "AMD EPYC"
    assert "avx2" in flags and "avx512f" not in flags  # the first processor's flags
    cpu = CpuInfo(model, flags, 2, "x86_64", "AVX2")
    assert cpu.kind == "AVX2"
    assert cpu.key_flags()["avx2"] and not cpu.key_flags()["avx512_bf16"]
    assert "avx2 yes" in cpu.describe() and "amx_bf16 no" in cpu.describe()
    model, flags = parse_cpuinfo(ARM)
    assert model == "unknown CPU" and "asimddp" in flags
    assert CpuInfo(model, flags, 4, "aarch64", "DEFAULT").kind == "aarch64"
    bf16 = CpuInfo("x", frozenset({"avx2", "avx512f", "avx512_bf16"}), 2, "x86_64", "AVX512")
    assert bf16.kind == "AVX512-BF16"
    assert read_cpu_info().logical_cpus >= 1


def test_an_avx2_cap_in_the_environment_takes_avx512_and_amx_off_the_flags():
    from pd.worker.model.tuning.cpu_info import effective_flags, isa_limits

    amx = frozenset(
        {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "avx_vnni"}
    )
    assert isa_limits({"PATH": "/bin"}) == {}
    assert effective_flags(amx, {}) == amx
    capped = effective_flags(amx, isa_limits({"ONEDNN_MAX_CPU_ISA": "AVX2"}))
    assert capped == {"avx2", "fma"}
    assert effective_flags(amx, {"ATEN_CPU_CAPABILITY": "AVX2"}) == capped  # case-insensitive
    assert effective_flags(amx, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}) == amx  # not an AVX2 cap
    cpu = CpuInfo("x", capped, 2, "x86_64", "AVX2", (("ONEDNN_MAX_CPU_ISA", "AVX2"),))
    assert cpu.kind == "AVX2" and "capped by ONEDNN_MAX_CPU_ISA=AVX2" in cpu.describe()
    assert cpu.as_dict()["limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def _fake(name: str, tol: float, bits: float = 32) -> Candidate:
    return Candidate(name, torch.float32, "fp32", bits, "op", tol, lambda w, rows: lambda x: x)


def test_report_sums_a_step_and_picks_the_fastest_within_tolerance():
    shapes = [Shape("a", 4, 4, 10), Shape("lm_head", 8, 4, 1)]
    cands = [_fake("slow", 1e-3), _fake("fast", 1e-3), _fake("wrong", 1e-3)]
    us = {"slow": 100.0, "fast": 50.0, "wrong": 1.0}
    timings = []
    for c in cands:
        for shape, rows in cells(shapes, [2], [16]):
            t = us[c.name] * (3 if rows == 16 else 1) * (2 if shape.is_head else 1)
            err = 0.5 if c.name == "wrong" and shape.is_head else 1e-6
            timings.append(Timing(c.name, shape.name, rows, [t / 1e6] * 3, err, err))
    cpu = CpuInfo("cpu", frozenset({"avx2"}), 2, "x86_64", "AVX2")
    r = build_report(
        cpu=cpu, model="m", shapes=shapes, candidates=cands, skipped={"k": "not here"}, dropped={},
        timings=timings, decode_rows=[2], prefill_rows=[16], threads=2, clock="wall", read_gbps=10.0,
        load=(0.5, 0.7), wall_s=1.0,
    )  # fmt: skip
    slow = next(c for c in r["candidates"] if c["name"] == "slow")
    # decode: 10 layers x 100 us + the head 200 us at 2 rows = 1.2 ms -> 2 rows / 1.2 ms
    # 10 x 16 + 32 weights of 4 bytes over 1.2 ms
    assert slow["steps"]["2"] == {"step_ms": 1.2, "step_ms_min": 1.2, "bound_tok_s": 1666.7,
                                  "weights_gbps": 0.0, "max_rel_err": 1e-6, "ok": True}  # fmt: skip
    # prefill: 10 x 300 us at 16 rows + the head at 1 row (200 us) = 3.2 ms
    assert slow["steps"]["16"]["step_ms"] == 3.2
    wrong = next(c for c in r["candidates"] if c["name"] == "wrong")
    assert wrong["steps"]["2"]["ok"] is False
    assert r["within_tolerance"] == ["slow", "fast"]
    assert r["fastest"] == {"2": "fast", "16": "fast"}
    best = r["best_per_shape"]["any"]["2"]
    assert best["picks"] == {"a": "fast", "lm_head": "fast"}  # "wrong" is out everywhere
    text = format_report(r, per_shape=True)
    assert "CPU: cpu" in text and "not timed: not here" in text and " !" in text
    assert "fastest of those within tolerance everywhere: 2: fast, 16: fast" in text


def test_time_cell_interleaves_and_measures_the_error():
    shape = Shape("a", 64, 128, 1)
    w = torch.randn(64, 128) * 0.05
    both = [BY_NAME["fp32"], BY_NAME["bf16"]]
    for clock in kernels.CLOCKS.values():
        got = kernels.time_cell(shape, 3, w, both, 1e-4, 7, clock)
        assert [t.candidate for t in got] == ["fp32", "bf16"]
        assert all(5 <= len(t.samples_s) <= 7 for t in got)
        assert got[0].rel_err < 1e-5 < got[1].rel_err < 2e-2


@pytest.mark.parametrize("c", CANDIDATES, ids=lambda c: c.name)
def test_candidate_computes_what_fp32_computes(c: Candidate):
    cpu = read_cpu_info()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen) * 0.05
    x = torch.randn(5, 128, generator=gen)
    layer, why = try_build(c, w, 5)
    if layer is None:
        pytest.skip(f"{c.name} does not run on this CPU: {why}")
    with torch.inference_mode():
        y = layer(x.to(c.act_dtype))
    assert y.shape == (5, 64)
    _, err = rel_error(y, F.linear(x.double(), w.double()))
    if err > c.rel_tol and c.exact_needs and c.exact_needs not in cpu.flags:
        pytest.xfail(f"{c.name} loses {err:.3g} without {c.exact_needs} (known)")
    assert err <= c.rel_tol, f"{c.name}: relative error {err:.3g} over {c.rel_tol}"


def test_registered_as_a_pd_bench_subcommand():
    assert "kernels" in SUBCOMMANDS
    p = argparse.ArgumentParser()
    kernels.add_arguments(p)
    args = p.parse_args(["--candidates", "fp32,fbgemm-fp16", "--json"])
    assert args.threads == 2 and args.decode_rows == "1,8,32" and args.json


def test_drop_slow_stops_timing_a_far_slower_candidate():
    shapes = [Shape("a", 4, 4, 10)]
    cands = [_fake("fast", 1.0), _fake("ok", 1.0), _fake("scalar", 1.0)]
    us = {"fast": 10.0, "ok": 50.0, "scalar": 500.0}
    timings = [Timing(n, "a", 8, [u / 1e6]) for n, u in us.items()]
    kept, why = kernels.drop_slow(timings, cands, shapes, 8, 10.0)
    assert [c.name for c in kept] == ["fast", "ok"]
    assert why == {"scalar": "prefill not timed: 50x the fastest at rows=8"}


def test_decode_step_against_its_linear_layers_on_a_tiny_model():
    cfg = ModelConfig(
        name="t", architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4,
        rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    weights: dict[str, Weight] = {
        name: torch.randn(shape, generator=gen) * 0.1
        for name, shape in expected_weight_shapes(cfg).items()
    }
    steps = time_decode_step(cfg, weights, [1, 3], torch.float32, time.perf_counter, reps=2)
    assert [s["rows"] for s in steps] == [1, 3]
    for s in steps:
        assert s["forward_ms"] > 0 and s["linear_ms"] > 0
        assert s["rest_ms"] == pytest.approx(s["forward_ms"] - s["linear_ms"], abs=0.02)
    assert "rows=3: forward" in format_step("float32", steps)


def test_pd_bench_engine_marks_a_quantization_slower_than_none_at_a_stream_count():
    from pd.bench.engine import mark_slower_than_none

    runs = [
        {"quantization": "none", "streams": 1, "tok_s": 50.0},
        {"quantization": "none", "streams": 32, "tok_s": 500.0},
        {"quantization": "int4", "streams": 1, "tok_s": 80.0},
        {"quantization": "int4", "streams": 32, "tok_s": 200.0},
        {"quantization": "int8", "streams": 8, "tok_s": 90.0},
    ]
    mark_slower_than_none(runs)
    assert [r.get("slower_than_none") for r in runs] == [None, None, False, True, None]


def test_pd_bench_engine_configs_parse_and_bad_ones_are_refused():
    from pd.bench.engine import Config, parse_configs

    assert parse_configs("auto,bfloat16/int4,float32", []) == [
        Config("auto", "auto"), Config("bfloat16", "int4"), Config("float32", "auto")
    ]  # fmt: skip
    assert parse_configs("bfloat16/int4@8+onednn-bf16", [])[0].name == "bfloat16/int4@8+onednn-bf16"
    headed = parse_configs("bfloat16/int4/fbgemm-int8@8+int8", [])[0]
    assert headed == Config("bfloat16", "int4", "fbgemm-int8@8+int8")
    assert headed.name == "bfloat16/int4/fbgemm-int8@8+int8"
    every = parse_configs("all", ["none", "int4"])
    assert [c.name for c in every] == [
        "auto", "float32/none", "float32/int4", "bfloat16/none", "bfloat16/int4"
    ]  # fmt: skip
    for bad in ("float64/none", "bfloat16/int3", "bfloat16/int4@0+none", "bfloat16/int4/int3"):
        with pytest.raises(SystemExit, match="--configs"):
            parse_configs(bad, [])


ENGINE_RUNS = [
    {"config": "auto", "streams": 1, "tok_s": 60.0},
    {"config": "auto", "streams": 32, "tok_s": 600.0},
    {"config": "bfloat16/int4", "streams": 1, "tok_s": 66.0},
    {"config": "bfloat16/int4", "streams": 32, "tok_s": 300.0},
    {"config": "float32/fbgemm-int8", "streams": 1, "tok_s": 90.0},  # over the bound
    {"config": "bfloat16/onednn-bf16", "streams": 32, "tok_s": 620.0},
]


def test_pd_bench_engine_targets_compare_the_default_with_the_best_passing_config():
    from pd.bench.engine import targets

    runs = ENGINE_RUNS
    ppl = {"bfloat16/int4": 1.006, "float32/fbgemm-int8": 1.7, "bfloat16/onednn-bf16": 1.003}
    llama = {"tok_s_1_stream": 80.0, "prefill_tok_s": 200.0}
    t = targets(runs, {"auto": 2000.0}, llama, ppl)
    assert t["default_over_best_1"] == {"best": "bfloat16/int4", "ratio": round(60 / 66, 3)}
    assert t["default_over_best_32"] == {"best": "bfloat16/onednn-bf16", "ratio": 0.968}
    assert t["default_1_over_llama_cpp_1"] == 0.75
    assert t["default_32_over_llama_cpp_1"] == 7.5
    assert t["default_prefill_over_llama_cpp"] == 10.0
    assert "default_1_over_llama_cpp_1" not in targets(runs, {}, {"skipped": "x"}, ppl)
    # a head-to-head's medians decide the 1-stream ratio; the separate figures' stays beside it
    duel = {"ratio": 1.05, "pd_median": 84.0, "llama_cpp_median": 80.0}
    t = targets(runs, {"auto": 2000.0}, llama, ppl, duel)
    assert t["default_1_over_llama_cpp_1"] == 1.05
    assert t["default_1_over_llama_cpp_1_separately"] == 0.75
    assert t["default_32_over_llama_cpp_1"] == 7.5  # from the separate figures
    # measured in turns with the best explicit configuration: those medians decide
    duels = {
        32: {"best": "bfloat16/onednn-bf16", "ratio": 1.01},
        1: {"best": "float32/fbgemm-int8"},
    }
    t = targets(runs, {"auto": 2000.0}, llama, ppl, duel, duels)
    assert t["default_over_best_32"] == {
        "best": "bfloat16/onednn-bf16", "ratio": 1.01, "separately": 0.968
    }  # fmt: skip
    # a duel with another configuration (fastest, but over the bound) does not count
    assert t["default_over_best_1"] == {"best": "bfloat16/int4", "ratio": round(60 / 66, 3)}
    # nor one that could not run
    skipped = {32: {"best": "bfloat16/onednn-bf16", "skipped": "the worker exited"}}
    t = targets(runs, {"auto": 2000.0}, llama, ppl, duel, skipped)
    assert t["default_over_best_32"] == {"best": "bfloat16/onednn-bf16", "ratio": 0.968}


def test_pd_bench_engine_duels_the_default_with_the_fastest_explicit_config():
    from pd.bench.engine import fastest_explicit

    runs = [*ENGINE_RUNS, {"config": "bfloat16/none", "streams": 8, "tok_s": 100.0}]
    # the fastest, whatever its perplexity (measured after the servers: `targets` checks), and
    # none at 8 streams, where auto did not run
    assert fastest_explicit(runs, [1, 8, 32]) == {
        1: "float32/fbgemm-int8", 32: "bfloat16/onednn-bf16"
    }  # fmt: skip
    assert fastest_explicit(runs[:2], [1, 32]) == {}  # nothing explicit: no duel


def test_pd_bench_engine_says_why_llama_cpp_did_not_run(monkeypatch):
    import argparse
    import importlib.util

    from pd.bench import engine, llama_cpp

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name)
    )
    why = llama_cpp.unavailable()
    assert "llama_cpp is not installed" in why and "llama-cpp-python[server]" in why
    out = engine.measure_llama_cpp(argparse.Namespace(max_tokens=8), 1, [])
    assert out == {"skipped": why}
    assert engine.head_to_head(argparse.Namespace(max_tokens=8), 1) == {"skipped": why}
    assert llama_cpp.decode_body(frozenset({2, 0})) == {"logit_bias": {"0": -100.0, "2": -100.0}}


def test_pd_bench_engine_prints_the_duels_and_the_ones_that_did_not_run(capsys):
    from pd.bench.engine import print_summary

    run = {"config": "auto", "streams": 32, "tok_s": 300.0, "step_ms": 106.7, "linear_ms": 60.0}
    run |= {"step_mb": 600.0, "bound_tok_s": 1600.0, "share_of_bound": 0.19}
    summary = {
        "cpu_line": "a CPU", "read_gbps": 30.0, "threads": 2, "runs": [run],
        "kernels": {"auto": {"dtype": "float32", "quantization": "int4@8+onednn-fp32", "how": "x"}},
        "prefill_tok_s": {}, "perplexity_ratio": {}, "refused": {}, "targets": {},
        "start": {"auto": {"ready_s": 41.2, "first_stream_tok_s": 38.0, "warm_stream_tok_s": 40.0,
                           "first_over_warm": 0.95}},
        "default_against_best": {
            "32": {"best": "float32/onednn-fp32", "default_tok_s": [306.7, 288.4],
                   "best_tok_s": [272.8, 272.4], "ratio": 1.057},
            "1": {"best": "float32/int4", "skipped": "the worker exited"},
        },
    }  # fmt: skip
    print_summary(summary)
    out = capsys.readouterr().out
    assert (
        "default against float32/onednn-fp32 at 32 streams, in turns x2" in out and "1.057x" in out
    )
    assert "default against float32/int4 at 1 streams: not run (the worker exited)" in out
    assert "auto: ready 41.2 s after its start; a 64-token stream at once 38.0 tok/s" in out
    assert "once warm 40.0 (0.95x)" in out
