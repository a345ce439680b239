"""`RMSNorm`'s CPU form (the first half of `layer_norm([x, -x])`) against torch's `F.rms_norm`."""

import pytest
import torch
import torch.nn.functional as F

from pd.worker.model.llama import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 257])
def test_rms_norm_matches_torch(dtype, rows):
    torch.manual_seed(rows)
    hidden = 576
    x = (torch.randn(rows, hidden) * 3 + 0.5).to(dtype)  # a mean far from zero: not a layer norm
    w = torch.randn(hidden).to(dtype)
    got = RMSNorm(w, 1e-5)(x)
    want = F.rms_norm(x, (hidden,), w, 1e-5)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    # torch rounds once after the weight; RMSNorm rounds the normalized x, then the product:
    # at most about one ulp of the dtype apart
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=ulp, atol=ulp * want.abs().max().item())


def test_rms_norm_of_zeros_is_finite():
    x = torch.zeros(2, 64)
    assert torch.equal(RMSNorm(torch.ones(64), 1e-6)(x), x)  # eps keeps it finite
