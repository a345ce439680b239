"""The roofline cost model: each regime bound by what bounds it on a GPU."""

from __future__ import annotations

import pytest

from pd.sim import CostModel, parse_profile


@pytest.fixture
def h100_8b() -> CostModel:
    return CostModel(parse_profile("llama-3.1-8b:h100:tp1"))


def test_small_decode_batches_cost_the_weight_read(h100_8b):
    p = h100_8b.profile
    read_s = p.model.weight_bytes / (p.device.hbm_bandwidth * p.device.memory_efficiency)
    # One row: every weight read once, plus a little KV, the head and the fixed overhead.
    assert read_s < h100_8b.decode_s(1, 128) < read_s * 1.1 + p.device.step_overhead_s
    # Memory-bound: 8 rows cost about what one does.
    assert h100_8b.decode_s(8, 128) / h100_8b.decode_s(1, 128) < 1.1


def test_long_context_decode_grows_with_kv_read(h100_8b):
    short, long = h100_8b.decode_s(64, 512), h100_8b.decode_s(64, 8192)
    p = h100_8b.profile
    extra_bytes = 64 * (8192 - 512) * p.model.kv_bytes_per_token
    expect = extra_bytes / (p.device.hbm_bandwidth * p.device.memory_efficiency)
    assert long - short == pytest.approx(expect, rel=0.05)


def test_prefill_is_compute_bound_and_linear_in_tokens(h100_8b):
    p = h100_8b.profile
    flops = p.device.peak_flops * p.device.compute_efficiency
    t = h100_8b.prefill_s(4096)
    assert t > 2 * p.model.params * 4096 / flops * 0.9
    assert h100_8b.prefill_s(2048) / h100_8b.prefill_s(1024) == pytest.approx(2, rel=0.1)


def test_tp_splits_the_work_but_pays_all_reduces():
    one = CostModel(parse_profile("llama-3.1-8b:h100:tp1"))
    two = CostModel(parse_profile("llama-3.1-8b:h100:tp2"))
    assert 0.5 < two.decode_s(1, 512) / one.decode_s(1, 512) < 0.75
    assert two.step(((0, 2048),)).allreduce_s > 0
    assert one.step(((0, 2048),)).allreduce_s == 0


def test_kv_transfer_takes_bytes_over_the_link():
    c = CostModel(parse_profile("llama-3.1-70b:h100:tp4"))
    link = c.profile.link
    assert link is not None
    nbytes = 8192 * c.profile.model.kv_bytes_per_token  # 2.7 GB for 8k tokens of 70B
    assert c.kv_transfer_s(8192) == pytest.approx(link.latency_s + nbytes / (4 * link.bandwidth))


def test_empty_step_costs_nothing(h100_8b):
    assert h100_8b.step_s([]) == 0.0
