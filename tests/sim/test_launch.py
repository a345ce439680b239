"""The simulated cluster's launcher: hosts of several workers, and the clock check."""

from __future__ import annotations

import pytest

from pd.sim.launch import host_groups, overshoot
from pd.worker.simulated.host import worker_configs


def test_hosts_group_workers_of_one_role():
    roles = ["prefill"] * 5 + ["decode"] * 3
    assert host_groups(roles, 4) == [[0, 1, 2, 3], [4], [5, 6, 7]]
    assert host_groups(roles, 8) == [[0, 1, 2, 3, 4], [5, 6, 7]]
    with pytest.raises(ValueError):
        host_groups(roles, 0)


def test_host_configs_share_flags_and_take_their_ports():
    cfgs = worker_configs(
        ["prefill", "decode"],
        ["--simulate", "llama-3.1-8b:h100", "--time-scale", "5"],
        [9001, 9002],
    )
    assert [(c.role, c.port, c.simulate, c.time_scale) for c in cfgs] == [
        ("prefill", 9001, "llama-3.1-8b:h100", 5.0),
        ("decode", 9002, "llama-3.1-8b:h100", 5.0),
    ]
    with pytest.raises(ValueError, match="simulated workers only"):
        worker_configs(["both"], [])
    with pytest.raises(ValueError, match="ports"):
        worker_configs(["both", "both"], ["--simulate", "llama-3.1-8b:h100"], [1])


def test_overshoot_is_the_real_time_past_the_scaled_model_over_the_run():
    before = {"a": {"modeled_s": 1.0, "real_s": 10.0, "steps": 10, "time_scale": 10.0}}
    after = {
        "a": {"modeled_s": 2.0, "real_s": 20.5, "steps": 30, "time_scale": 10.0},
        "b": {"modeled_s": 1.0, "real_s": 10.0, "steps": 5, "time_scale": 10.0},
    }
    got = overshoot(before, after)
    # a: 10.5 s real for 1.0 s modeled x 10 (5% over); b: exactly on time from its start.
    assert got["per_worker"] == {"a": 0.05, "b": 0.0}
    assert got["worst"] == 0.05 and got["steps"] == 25
