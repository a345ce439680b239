"""When a worker compiles its one-row decode step in the background, and what it installs."""

from __future__ import annotations

import types

import pytest

from pd.worker.model.one_row import BackgroundCompile, one_row_format, wanted


def test_the_background_compile_runs_only_when_asked_for():
    assert wanted("off", device="cpu", quantization="int4") is None  # the default
    assert wanted("on", device="cpu", quantization="none")
    assert wanted("on", device="cpu", quantization="int4@8+none")


def test_on_refuses_what_it_cannot_compile():
    with pytest.raises(ValueError, match="one-row weights"):
        wanted("on", device="cpu", quantization="onednn-int8")
    with pytest.raises(ValueError, match="CPU"):
        wanted("on", device="cuda", quantization="none")


def test_the_one_row_format_is_a_splits_small_one():
    assert one_row_format("int4@8+none") == "int4"
    assert one_row_format("int8") == "int8"


def test_a_compiled_step_that_times_slower_is_never_installed():
    model = types.SimpleNamespace(compiled_one_row=None, ranks=[])
    bg = BackgroundCompile(model, 16, range(10, 13), 2, "test")  # type: ignore[arg-type]

    calls = []

    def step(*args):
        calls.append(args)
        return "logits"

    bg.decide(step, eager_ms=10.0, compiled_ms=10.5)
    assert bg.state == "slower" and model.compiled_one_row is None
    bg.decide(step, eager_ms=10.0, compiled_ms=8.0)
    assert bg.state == "on" and model.compiled_one_row is not None
    assert model.compiled_one_row(1, 2) == "logits" and calls == [(1, 2)]  # as served


def test_inductors_cache_is_kept_apart_per_cpu_and_cap(monkeypatch, tmp_path):
    from pd.worker.model.inductor_cache import inductor_cache_name, use_pd_inductor_cache
    from pd.worker.model.tuning.cpu_info import CpuInfo

    flags = frozenset({"avx2", "avx512f", "avx512_bf16"})
    cpu = CpuInfo("AMD EPYC", flags, 2, "x86_64", "AVX512")
    capped = CpuInfo(
        "AMD EPYC", frozenset({"avx2"}), 2, "x86_64", "AVX2", (("ATEN_CPU_CAPABILITY", "avx2"),)
    )
    name = inductor_cache_name(cpu)
    assert name.startswith("avx512-bf16-") and name == inductor_cache_name(cpu)
    assert inductor_cache_name(capped).startswith("avx2-") and inductor_cache_name(capped) != name
    other = CpuInfo("Intel(R) Xeon(R)", flags, 2, "x86_64", "AVX512")
    assert inductor_cache_name(other) != name
    # use_pd_inductor_cache sets the variable itself: monkeypatch it first, so it is undone
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    assert use_pd_inductor_cache() == "/elsewhere"  # the user's own wins
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    path = use_pd_inductor_cache()
    assert path.startswith(str(tmp_path / "inductor")) and path != str(tmp_path / "inductor")
    # importing inductor writes its default folder into the environment: not the user's choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert use_pd_inductor_cache() == path
