"""Suite-wide: no worker a test starts (in process or as a `pd-worker` process, which inherits
the environment) runs the `--dtype/--quantization auto` search (pd/worker/model/tuning/kernel_choice.py):
auto takes the fixed rule, so the suite is as fast and as deterministic as before. The tests of
the search itself set the variable back.

Inductor's cache is pd's folder for this CPU as capped (pd/worker/model/inductor_cache.py), for
the tests that call torch.compile themselves as well: inductor's default folder mixes graphs
compiled with and without `scripts/as_avx2.sh`, and a capped run that loaded uncapped graphs
computed NaNs."""

import os

import pytest

from pd.worker.model.inductor_cache import use_pd_inductor_cache

os.environ["PD_KERNEL_SEARCH"] = "0"
use_pd_inductor_cache()

E2E = os.path.join("tests", "e2e") + os.sep
# Tests that start a few real worker processes of their own (no session fixture) and spend
# most of their time waiting on them (a soak's kills, heartbeats, a planner's cool-down; the
# deterministic check's four workers): a group of their own, which runs on the other test
# process beside the end-to-end group. What goes here balances the two: a timed run (`pytest -n
# 2 --dist loadgroup --durations=0`, 2 cores, 2026-12-07) summed the end-to-end group's tests
# to 753 s and everything else to 701 s before test_deterministic.py (24 s) moved here.
OWN_WORKERS = {
    ("bench", "test_soak.py"),
    ("bench", "test_routing.py"),
    ("e2e", "test_lifecycle.py"),
    ("e2e", "test_planner_local.py"),
    ("e2e", "test_deterministic.py"),
}


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (scripts/test.sh: `--dist loadgroup`) the end-to-end tests run in one
    process: their session fixtures (a worker in process, a P/D pair of processes) start once,
    and the two test processes never hold two such sets of workers at once (on a 24 GiB machine
    two did not fit: the kernel's OOM killer took a test process). The tests of `OWN_WORKERS`
    (a P and a D or three, ~4 GiB) are a second group: xdist hands the largest group to one
    process and the next to the other (`--loadscope-reorder`, its default), so they run at the
    start beside the end-to-end group and the rest follows them; the end-to-end group alone
    used to be the run's wall time (891 s against 508 s for everything else, 2 cores)."""
    for item in items:
        where = (item.path.parent.name, item.path.name)
        if where in OWN_WORKERS:
            item.add_marker(pytest.mark.xdist_group("e2e-own-workers"))
        elif E2E in str(item.path):
            item.add_marker(pytest.mark.xdist_group("e2e"))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, on the controller
def pytest_xdist_node_collection_finished(node, ids):
    """Stop a run whose groups do not hold: under `--dist loadgroup` a grouped test's id ends
    with its group (`@e2e`), and where it does not (pytest 9.2 with pytest-xdist 3.8,
    pytest-xdist#1386) the end-to-end tests would run in both processes at once, two sets of
    workers on 2 cores, and time out instead of failing clearly."""
    if node.config.getoption("dist", None) != "loadgroup":
        return
    lost = [i for i in ids if i.startswith(E2E.replace(os.sep, "/")) and "@" not in i]
    if lost:
        pytest.exit(
            f"pytest-xdist did not group {len(lost)} end-to-end tests (e.g. {lost[0]}): this "
            "pytest and pytest-xdist do not keep --dist loadgroup (pytest-xdist#1386); install "
            "the versions pyproject.toml's test extras allow (pip install -e '.[test]')",
            returncode=4,
        )
