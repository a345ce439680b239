"""The cost model against published figures (pd/sim/validation.py, docs/simulation.md): each
prediction within its stated factor, each figure traceable to its source's words, and a broken
model (a factor of 2 in bandwidth or FLOP/s) caught."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from pd.sim import validation as v
from pd.sim.profile import PRESETS, device_preset

DOC = Path(__file__).resolve().parents[2] / "docs" / "simulation.md"


def _shipped() -> v.Factors:
    d = device_preset("h100")
    return v.Factors(d.compute_efficiency, d.memory_efficiency, d.step_overhead_s)


@pytest.mark.parametrize(
    "figure", v.FIGURES, ids=[f"{i}-{f.profile}-{f.kind}" for i, f in enumerate(v.FIGURES, 1)]
)
def test_prediction_is_within_the_stated_factor(figure):
    ch = v.Check(figure, v.predict(figure))
    assert ch.off_by <= v.tolerance(figure), (
        f"{figure.condition}: model {ch.predicted:.4g}, published {figure.published:.4g} "
        f"(ratio {ch.ratio:.2f}, tolerance {v.tolerance(figure)})"
    )


@pytest.mark.parametrize("figure", v.FIGURES)
def test_each_figure_is_quoted_from_a_known_source(figure):
    assert figure.source in v.SOURCES
    assert v.SOURCES[figure.source].url.startswith("https://")
    numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", figure.quote)]
    assert any(math.isclose(n, figure.published, rel_tol=1e-9) for n in numbers), figure.quote
    assert figure.condition


@pytest.mark.parametrize(
    "broken",
    [
        {"memory_efficiency": 0.5},
        {"memory_efficiency": 2.0},
        {"compute_efficiency": 0.5},
        {"compute_efficiency": 2.0},
    ],
    ids=["bandwidth/2", "bandwidth*2", "flops/2", "flops*2"],
)
def test_a_factor_of_two_error_is_caught(broken):
    base = _shipped()
    factors = dataclasses.replace(
        base, **{k: getattr(base, k) * scale for k, scale in broken.items()}
    )
    failing = [c for c in v.check(factors=factors) if c.off_by > v.tolerance(c.figure)]
    assert len(failing) >= 3


def test_shipped_factors_are_the_fit():
    """The presets sit at the least-squares point: no step of the fit's grid improves on them."""
    base = _shipped()
    figures = [f for f in v.FIGURES if v.calibrates(f)]
    best = v.loss(v.check(figures, base))
    for field, step in (
        ("compute_efficiency", 0.01),
        ("memory_efficiency", 0.01),
        ("step_overhead_s", 0.0001),
    ):
        for sign in (-1, 1):
            moved = dataclasses.replace(base, **{field: getattr(base, field) + sign * step})
            assert v.loss(v.check(figures, moved)) >= best, (field, sign)


def test_devices_share_the_fitted_factors():
    keys = ("compute_efficiency", "memory_efficiency", "step_overhead_s")
    values = {name: tuple(d[k] for k in keys) for name, d in PRESETS["devices"].items()}
    assert len(set(values.values())) == 1, values


def test_held_out_figures_are_decode_steps_at_tp_above_one():
    held = [f for f in v.FIGURES if not v.calibrates(f)]
    assert held and all(f.kind == "itl_ms" and ":tp1" not in f.profile for f in held)
    assert v.TOLERANCE < v.TOLERANCE_HELD_OUT


def test_fp8_figures_read_one_byte_weights_at_the_fp8_peak():
    fig = next(f for f in v.FIGURES if f.precision == "fp8")
    p = v.profile_of(fig)
    assert p.model.dtype_bytes == 1
    assert p.device.peak_flops == 2 * device_preset(p.device.name).peak_flops


def test_the_doc_names_every_source():
    text = DOC.read_text()
    for source in v.SOURCES.values():
        assert source.url in text, source.key


def test_the_doc_table_is_the_current_one():
    """docs/simulation.md carries `python -m pd.sim.validation --markdown` as printed now."""
    assert v.markdown(v.check()) in DOC.read_text()
