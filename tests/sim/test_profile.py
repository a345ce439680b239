"""Profiles of the simulated device: presets, profile files, the KV pool each one implies."""

from __future__ import annotations

import pytest

from pd.sim import CostModel, list_presets, parse_profile
from pd.sim.profile import model_preset


def test_presets_name_the_issue_models_and_devices():
    text = list_presets()
    for name in ("llama-3.1-8b", "llama-3.1-70b", "qwen3-32b", "h100", "h200", "b200"):
        assert name in text


def test_spec_string_reads_model_device_tp_and_link():
    p = parse_profile("llama-3.1-70b:h100:tp4:tcp-100g")
    assert (p.model.name, p.device.name, p.tp, p.link and p.link.name) == (
        "llama-3.1-70b",
        "h100",
        4,
        "tcp-100g",
    )
    assert p.name == "llama-3.1-70b:h100:tp4:tcp-100g"
    assert parse_profile("llama-3.1-8b:h200").link.name == "rdma-400g"  # the default link


def test_kv_bytes_per_token_of_llama_70b():
    # 80 layers x K and V x 8 KV heads x 128 dims x 2 bytes = 320 KiB a token.
    assert model_preset("llama-3.1-70b").kv_bytes_per_token == 80 * 2 * 8 * 128 * 2


def test_kv_pool_follows_memory_weights_and_tp():
    p1 = parse_profile("llama-3.1-8b:h100:tp1")
    # 80 GB x 0.9 less 16 GB of weights, over 128 KiB a token.
    assert p1.kv_tokens() == int((80e9 * 0.9 - 8.03e9 * 2) // (32 * 2 * 8 * 128 * 2))
    p2 = parse_profile("llama-3.1-8b:h100:tp2")
    assert p2.kv_tokens() > 2 * p1.kv_tokens()  # the weights are paid once over both GPUs
    assert parse_profile("llama-3.1-8b:h200").kv_tokens() > p1.kv_tokens()


def test_a_model_that_does_not_fit_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="more TP"):
        parse_profile("llama-3.1-70b:h100:tp1").kv_pages(16)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("llama-3.1-8b", "MODEL:DEVICE"),
        ("llama-9:h100", "unknown model"),
        ("llama-3.1-8b:a100", "unknown device"),
        ("llama-3.1-8b:h100:tp3", "does not divide"),
        ("llama-3.1-8b:h100:tp1:carrier-pigeon", "unknown link"),
    ],
)
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_profile(spec)


def test_profile_file_with_its_own_device_and_a_measured_table(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text(
        """
model = "llama-3.1-8b"
tp = 1
[device]
name = "mygpu"
peak_flops = 100e12
hbm_bandwidth = 1e12
memory_bytes = 48e9
interconnect_bandwidth = 1e11
compute_efficiency = 0.5
memory_efficiency = 0.8
step_overhead_s = 0.001
[[prefill_table]]
tokens = 1000
seconds = 0.1
[[prefill_table]]
tokens = 2000
seconds = 0.2
[[decode_table]]
rows = 1
context = 1000
seconds = 0.02
[[decode_table]]
rows = 64
context = 1000
seconds = 0.04
"""
    )
    p = parse_profile(str(f))
    assert p.device.name == "mygpu" and p.prefill_table and p.decode_table
    c = CostModel(p)
    assert c.prefill_s(1500) == pytest.approx(0.15)
    assert c.decode_s(32, 1000) == pytest.approx(0.02 + 0.02 * 31 / 63)


def test_profile_file_unknown_keys_are_refused(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('model = "llama-3.1-8b"\ndevice = "h100"\nbatch = 3\n')
    with pytest.raises(ValueError, match="unknown keys"):
        parse_profile(str(f))
