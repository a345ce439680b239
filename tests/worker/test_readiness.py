"""Readiness (pd/worker/readiness.py): it flips only after the admission condition held 2 s,
both ways, and draining is never ready."""

from __future__ import annotations

from pd.worker.readiness import Readiness


def test_readiness_flips_after_the_condition_holds_and_not_on_a_blip():
    r = Readiness(hold_s=2.0)
    r.update(0.0, None)
    assert r.state(False) == (True, None)
    r.update(1.0, "the KV pool is full")
    r.update(2.9, "the KV pool is full")
    assert r.state(False)[0]  # 1.9 s: not yet
    r.update(3.0, "the KV pool is full")
    ready, why = r.state(False)
    assert not ready and "for 2s: the KV pool is full" in why
    r.update(3.5, None)
    r.update(4.0, "the running batch is full")  # a blip of admission: the clock starts again
    r.update(5.4, None)
    r.update(7.3, None)
    assert not r.state(False)[0]
    r.update(7.4, None)
    assert r.state(False) == (True, None)
    assert r.state(True) == (False, "draining")


def test_a_starting_worker_is_not_ready_until_its_start_up_is_over():
    r = Readiness(hold_s=2.0, starting_until=10.0)
    assert r.state(False) == (False, "starting")  # before its first tick, too
    r.update(9.9, None)
    assert r.state(False) == (False, "starting")
    assert r.state(True) == (False, "draining")  # a drain wins
    r.update(10.0, None)
    assert r.state(False) == (True, None)


def test_a_parked_worker_is_not_ready_until_activated_then_starts():
    r = Readiness(hold_s=2.0)
    r.parked = True
    r.update(0.0, None)
    assert r.state(False) == (False, "parked")
    r.activate(5.0, startup_s=1.0)
    r.update(5.5, None)
    assert r.state(False) == (False, "starting")
    r.update(6.0, None)
    assert r.state(False) == (True, None)
    # Drained back into the pool: parked, and a start-up again at the next activation
    r.park()
    r.update(7.0, None)
    assert r.state(False) == (False, "parked")
    r.activate(8.0, startup_s=1.0)
    r.update(8.5, None)
    assert r.state(False) == (False, "starting")
    r.update(9.0, None)
    assert r.state(False) == (True, None)
