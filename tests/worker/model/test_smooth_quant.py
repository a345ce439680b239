"""smooth-int8 (smooth_quant.py): SmoothQuant's scales against a plain per-tensor int8 product,
the calibration's maxima against the norm they record, and the model built on it."""

from __future__ import annotations

import pytest
import torch

from pd.worker.model.kernels import DynamicInt8Linear, OneDnnLinear, onednn_refusal
from pd.worker.model.quant import SplitLinear, make_linear
from pd.worker.model.smooth_quant import (
    SmoothInt8Linear,
    activation_maxima,
    holds_smooth,
    smoothing_scales,
)

CPU = torch.device("cpu")
needs_fbgemm = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines,
    reason="torch on this machine has no FBGEMM quantized engine",
)


def test_the_scales_share_the_spread_between_activations_and_weights():
    act = torch.tensor([1.0, 100.0, 4.0])
    w = torch.tensor([[1.0, 1.0, 4.0], [-1.0, 0.5, 1.0]])  # column maxima 1, 1, 4
    s = smoothing_scales(act, w)
    # alpha 0.5: s = sqrt(a / w), so both get sqrt(a * w) as their largest
    torch.testing.assert_close(s, torch.tensor([1.0, 10.0, 1.0]))
    torch.testing.assert_close(act / s, w.abs().amax(0) * s)


@needs_fbgemm
def test_smoothing_saves_a_product_whose_input_has_an_outlier_channel():
    torch.manual_seed(0)
    w = torch.randn(256, 512) / 512**0.5
    x = torch.randn(32, 512)
    x[:, 7] *= 80  # one channel far larger than the rest, as a norm's output has
    ref = x @ w.t()
    plain = DynamicInt8Linear(w, None, "fbgemm", reduce_range=True)(x)
    smooth = SmoothInt8Linear(w, None, x.abs().amax(0))(x)
    plain_err = ((plain - ref).norm() / ref.norm()).item()
    smooth_err = ((smooth - ref).norm() / ref.norm()).item()
    assert smooth_err < 0.02 and smooth_err < plain_err / 3, (smooth_err, plain_err)


@needs_fbgemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smooth_int8_smooths_the_calibrated_layers_and_runs_onednn_for_the_rest(dtype):
    if onednn_refusal("onednn-fp32"):
        pytest.skip(f"no oneDNN fp32 linear here: {onednn_refusal('onednn-fp32')}")
    torch.manual_seed(0)
    w, x, bias = torch.randn(96, 128), torch.randn(5, 128), torch.randn(96)
    calibrated = make_linear(w, bias.to(dtype), "smooth-int8", 32, dtype, CPU, x.abs().amax(0))
    other = make_linear(w, bias.to(dtype), "smooth-int8", 32, dtype, CPU)
    assert isinstance(calibrated, SmoothInt8Linear) and isinstance(other, OneDnnLinear)
    # bf16 where this CPU's torch has a oneDNN bf16 linear, fp32 otherwise
    assert other.dtype in (dtype, torch.float32)
    ref = x @ w.t() + bias
    for layer in (calibrated, other):
        y = layer(x.to(dtype))
        assert y.dtype == dtype and (y.float() - ref).abs().max() < 0.07 * ref.abs().max()
    split = make_linear(w, None, "int4@4+smooth-int8", 32, dtype, CPU, x.abs().amax(0))
    assert isinstance(split, SplitLinear) and isinstance(split.large, SmoothInt8Linear)
    assert holds_smooth("int4@4+smooth-int8") and not holds_smooth("fbgemm-int8")


def test_the_calibration_records_each_norms_largest_output():
    from pd.worker.model.llama import RMSNorm
    from pd.worker.model.smooth_quant import calibration_text
    from tests.model_fixtures import default_checkpoint

    ckpt = default_checkpoint()
    cfg = ckpt.config
    maxima = activation_maxima(cfg, ckpt.weights, ckpt.tokenizer.encode)
    assert len(maxima.attn) == len(maxima.mlp) == cfg.num_layers
    assert all(m.shape == (cfg.hidden_size,) and (m > 0).all() for m in maxima.attn + maxima.mlp)
    # layer 0's input norm reads the embeddings: its outputs, computed here directly
    ids = torch.tensor(ckpt.tokenizer.encode(calibration_text()))
    norm = RMSNorm(ckpt.weights["model.layers.0.input_layernorm.weight"], cfg.rms_norm_eps)
    h = ckpt.weights["model.embed_tokens.weight"][ids]
    torch.testing.assert_close(maxima.attn[0], norm(h).abs().amax(0), rtol=1e-4, atol=1e-5)


def test_a_runner_refuses_smooth_int8_without_a_calibration():
    from tests.model_fixtures import make_runner

    with pytest.raises(ValueError, match="activation maxima"):
        make_runner(quantization="smooth-int8")


@needs_fbgemm
def test_smooth_int8_keeps_the_models_perplexity_that_plain_int8_loses():
    """Measured: fbgemm-int8 1.63x fp32's perplexity with AVX512-VNNI (8-bit activations),
    2.72x under the AVX2 cap (7 bits); smooth-int8 1.011x and 1.032x (docs/EXPERIMENTS.md 14).
    The bound (1.02x) is the search's to judge on each machine; here, that smoothing is
    working at all."""
    from pd.worker.model.autotune import Candidate
    from pd.worker.model.kernel_search import PerplexityJudge, formats_here
    from pd.worker.model.perplexity import shipped_text
    from tests.model_fixtures import default_checkpoint

    if onednn_refusal("onednn-fp32"):
        pytest.skip(f"no oneDNN fp32 linear here: {onednn_refusal('onednn-fp32')}")
    ckpt = default_checkpoint()
    assert "smooth-int8" in formats_here(ckpt.config, 1, 32)
    ids = ckpt.tokenizer.encode(shipped_text())
    blind = PerplexityJudge(ckpt.config, ckpt.weights, ids, 1, 32)
    with pytest.raises(ValueError, match="tokenizer"):
        blind.ratio(Candidate("float32", "smooth-int8"))
    judge = PerplexityJudge(ckpt.config, ckpt.weights, ids, 1, 32, ckpt.tokenizer.encode)
    smooth = judge.ratio(Candidate("float32", "smooth-int8"))
    plain = judge.ratio(Candidate("float32", "fbgemm-int8"))
    assert smooth < 1.06 and smooth < 1 + (plain - 1) / 10, (smooth, plain)
