"""RouterConfig validation and the pd-router command line."""

from __future__ import annotations

import pytest

from pd.router import RouterConfig
from pd.router.main import parse_config


def test_urls_are_normalized_and_validated():
    cfg = RouterConfig(prefill=("p1:8100",), decode=("http://d1:8200/",))
    assert cfg.prefill == ("http://p1:8100",) and cfg.decode == ("http://d1:8200",)
    with pytest.raises(ValueError, match="more than once"):
        RouterConfig(prefill=("http://a:1",), decode=("a:1",))
    with pytest.raises(ValueError, match="not a worker URL"):
        RouterConfig(worker=("ftp://x",))


@pytest.mark.parametrize(
    "kw",
    [
        {"policy": "random"},
        {"decode_policy": "nope"},
        {"health_interval": 0},
        {"max_retries": -1},
        {"sticky_load_factor": 0.9},
        {"api_key": ""},
        {"port": 70000},
    ],
)
def test_bad_values_are_refused(kw):
    with pytest.raises(ValueError):
        RouterConfig(**kw)


def test_per_pool_policies():
    cfg = RouterConfig(policy="round-robin", decode_policy="sticky-to-room")
    assert cfg.policy_of("prefill") == "round-robin"
    assert cfg.policy_of("decode") == "sticky-to-room"
    assert cfg.policy_of("both") == "round-robin"


def test_command_line(monkeypatch):
    monkeypatch.setenv("PD_ROUTER_ADMIN_TOKEN", "from-env")
    cfg = parse_config(
        [
            "--prefill",
            "p:1",
            "--prefill",
            "p:2",
            "--decode",
            "d:1",
            "--policy",
            "sticky-to-room",
            "--health-interval",
            "0.5",
            "--access-log",
        ]
    )
    assert cfg.prefill == ("http://p:1", "http://p:2") and cfg.decode == ("http://d:1",)
    assert cfg.policy == "sticky-to-room" and cfg.health_interval == 0.5 and cfg.access_log
    assert cfg.admin_token == "from-env" and cfg.api_key is None
    with pytest.raises(SystemExit):
        parse_config(["--policy", "random"])
