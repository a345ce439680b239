"""int4-fp32 (issue 40, item 2): pd's own int4 kernel computes the weights' exact fp32
dequantization in fp32, and one row's bits are the same at every batch size and thread count."""

from __future__ import annotations

import pytest
import torch

from pd.worker.model.int4_fp32 import Int4Fp32Linear, int4_fp32_refusal, pack
from pd.worker.model.quant import make_linear, quantize_groups

pytestmark = pytest.mark.skipif(bool(int4_fp32_refusal()), reason=int4_fp32_refusal() or "-")

SHAPES = [(576, 576), (1536, 576), (576, 1536), (192, 576), (48, 64)]


def _layer(out: int, inp: int, seed: int = 0) -> tuple[Int4Fp32Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gq = quantize_groups(torch.randn(out, inp, generator=gen), 32)
    return Int4Fp32Linear(gq.q, gq.scale, gq.low, None), gq.dequantize()


@pytest.mark.parametrize("out,inp", SHAPES)
def test_it_computes_the_dequantized_weights_in_fp32(out, inp):
    layer, w = _layer(out, inp)
    x = torch.randn(37, inp, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ w.double().T
    err = (layer(x).double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5  # fp32 sums of the exact weights (bf16 activations would give ~1e-3)


@pytest.mark.parametrize("out,inp", SHAPES[:3])
def test_a_row_has_the_same_bits_in_any_batch_and_at_any_thread_count(out, inp):
    layer, _ = _layer(out, inp)
    x = torch.randn(300, inp, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        everything = layer(x)  # passes of 96 rows, micro-kernels of 6 (the C file)
        for start, rows in [(0, 1), (5, 1), (7, 2), (11, 6), (20, 7), (33, 95), (40, 130)]:
            assert torch.equal(layer(x[start : start + rows]), everything[start : start + rows])
        torch.set_num_threads(1)
        assert torch.equal(layer(x[3:4]), everything[3:4])
        assert torch.equal(layer(x[100:300]), everything[100:300])
    finally:
        torch.set_num_threads(before)


def test_the_layout_holds_each_block_of_16_outputs_per_pair_of_inputs():
    q = torch.arange(32 * 64).remainder(16).view(32, 64).to(torch.uint8)
    scale, low = torch.rand(32, 2), torch.rand(32, 2)
    packed, scales, lows = pack(q, scale, low)
    assert packed.shape == (2, 32, 16) and scales.shape == (2, 2, 16) == lows.shape
    # block 1, inputs 10 and 11, byte 3: output 16 + 3's code for input 10 low, for 11 high
    assert packed[1, 5, 3] == q[19, 10] | (q[19, 11] << 4)
    assert scales[1, 1, 4] == scale[20, 1] and lows[0, 0, 15] == low[15, 0]
    assert scales.dtype == torch.float32  # rand's values are not all fp16 ones
    halves = pack(q, scale.half().float(), low.half().float())
    assert halves[1].dtype == torch.float16 == halves[2].dtype  # a GGUF's Q4_1: exactly fp16
    assert torch.equal(halves[1].float(), pack(q, scale.half().float(), low)[1])
    with pytest.raises(ValueError, match="blocks of 16"):
        pack(q[:24], scale[:24], low[:24])
    with pytest.raises(ValueError, match="even"):
        pack(q[:, :63], scale, low)


@pytest.mark.parametrize("out,inp", SHAPES[:2])
def test_fp16_scales_give_the_same_bits_as_the_same_values_in_fp32(out, inp):
    gen = torch.Generator().manual_seed(7)
    gq = quantize_groups(torch.randn(out, inp, generator=gen), 32)
    scale, low = gq.scale.half().float(), gq.low.half().float()  # as a GGUF stores them
    halves = Int4Fp32Linear(gq.q, scale, low, None)
    floats = Int4Fp32Linear(gq.q, scale, low, None)
    floats.scales, floats.lows, floats.half = floats.scales.float(), floats.lows.float(), 0
    assert halves.half == 1 and Int4Fp32Linear(gq.q, gq.scale, gq.low, None).half == 0
    x = torch.randn(40, inp, generator=gen)
    for rows in (1, 3, 40):
        assert torch.equal(halves(x[:rows]), floats(x[:rows]))
    w = (gq.q.float().view(out, -1, 32) * scale.unsqueeze(-1) + low.unsqueeze(-1)).view(out, inp)
    ref = x.double() @ w.double().T
    assert (halves(x).double() - ref).abs().max() / ref.abs().max() < 1e-5


def test_make_linear_packs_a_ggufs_groups_as_they_are_and_other_dtypes_convert():
    gq = quantize_groups(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)), 32)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    cpu = torch.device("cpu")
    layer = make_linear(gq, None, "int4-fp32", 32, torch.float32, cpu)
    assert torch.equal(layer(x), Int4Fp32Linear(gq.q, gq.scale, gq.low, None)(x))
    bias = torch.randn(64)
    bf = make_linear(gq, bias.bfloat16(), "int4-fp32", 32, torch.bfloat16, cpu)
    y = bf(x.bfloat16())
    assert y.dtype == torch.bfloat16
    ref = x.bfloat16().float() @ gq.dequantize().T + bias.bfloat16().float()
    assert torch.allclose(y.float(), ref, rtol=0.02, atol=0.05)
    assert make_linear(gq, None, "int4-fp32", 32, torch.float32, cpu)(x[:0]).shape == (0, 64)


def test_the_row_judge_finds_no_batch_where_it_differs():
    from pd.worker.model.config import ModelConfig
    from pd.worker.model.tuning.row_invariance import batch_rows, layers_differ

    cfg = ModelConfig("t", "llama", 256, 64, 128, 2, 4, 2, 16, 1e4, 1e-5, 128, True)
    rows = batch_rows(200, (100,))  # the micro-kernel's 6 rows and the pass's 96 straddled
    assert layers_differ("float32", "int4-fp32", cfg, 1, 32, rows) is None


def test_the_search_offers_it_with_the_exact_fp32_head_of_its_rule():
    from pd.worker.model.config import ModelConfig
    from pd.worker.model.kernels import onednn_refusal
    from pd.worker.model.quant import head_quantization, holds_int4
    from pd.worker.model.tuning.kernel_search import formats_here

    smollm = ModelConfig("m", "llama", 49152, 576, 1536, 30, 9, 3, 64, 1e4, 1e-5, 8192, True)
    assert "int4-fp32" in formats_here(smollm, 1, 32)
    odd_vocab = ModelConfig("t", "llama", 250, 64, 128, 2, 4, 2, 16, 1e4, 1e-5, 128, True)
    assert "int4" in formats_here(odd_vocab, 1, 32)  # its outputs in blocks of 16 or not at all
    assert "int4-fp32" not in formats_here(odd_vocab, 1, 32)
    assert holds_int4("int4-fp32") and holds_int4("int4-fp32@1+none") and not holds_int4("none")
    # the GGUF's head is Q8_0, not Q4_1: int4 groups made from it again are a new model
    exact = "none" if onednn_refusal("onednn-fp32") else "onednn-fp32"
    assert head_quantization("int4-fp32", torch.float32) == exact


def test_the_avx512_build_gives_the_avx2_builds_bits():
    from pd.worker.model.tuning.cpu_info import read_cpu_info

    if "avx512f" not in read_cpu_info().flags:
        pytest.skip("no AVX-512 here (or capped): only the AVX2 build runs")
    gq = quantize_groups(torch.randn(576, 1536, generator=torch.Generator().manual_seed(5)), 32)
    wide = Int4Fp32Linear(gq.q, gq.scale, gq.low, None, build="avx512")
    narrow = Int4Fp32Linear(gq.q, gq.scale, gq.low, None, build="avx2")
    for rows in (1, 5, 40, 200):
        x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(wide(x), narrow(x)), rows
