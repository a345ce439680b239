"""Free ports are chosen below the kernel's ephemeral range (where outgoing connections take
theirs), distinct, and bindable; with no room below it, the kernel chooses."""

from __future__ import annotations

import socket

from pd.ports import LOWEST, ephemeral_low, free_port, free_ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    ports = free_ports(20, low=32768)
    assert len(set(ports)) == 20
    assert all(LOWEST <= p < 32768 for p in ports)
    for p in ports[:3]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: binds


def test_a_port_in_use_is_never_chosen():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        assert taken not in free_ports(5, low=LOWEST + 1000)
        assert taken not in free_ports(5, low=LOWEST + 10)  # the kernel's choices


def test_the_ephemeral_range_is_read_and_a_missing_one_falls_back(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ephemeral_low(str(f)) == 40000
    assert ephemeral_low(str(tmp_path / "none")) is None
    assert 0 < free_port() < 65536
    few = free_ports(2, low=LOWEST + 10)  # no room below: the kernel's choice
    assert len(set(few)) == 2
