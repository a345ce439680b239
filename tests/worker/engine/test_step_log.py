"""The step record (pd/worker/engine/step_log.py): prompt tokens and the busy time of the steps
that computed them, the steps of decode rows alone as samples with their index, read after an
index so that a reader sees each sample once."""

from __future__ import annotations

from pd.worker.engine.step_log import StepLog


def test_prefill_chunks_count_tokens_and_busy_time_and_decode_steps_are_samples():
    log = StepLog(window=4)
    # A 100-token prompt in two chunks, a decode row of a 50-token prompt beside the first.
    log.record([100, 50], [0, 52], [60, 1], sampled=1, seconds=0.5)
    log.record([100], [60], [40], sampled=1, seconds=0.25)
    # Decode rows alone: two rows over 101 + 53 tokens of KV.
    log.record([100, 50], [100, 52], [1, 1], sampled=2, seconds=0.01)
    out = log.since(0)
    assert out["steps"] == 3
    assert out["prefill_tokens"] == 100  # the decode row of the first step is not a prompt's
    assert out["prefill_busy_s"] == 0.75
    assert out["prefills_done"] == 1
    assert out["sampled_tokens"] == 4
    assert out["samples"] == [[2, 154, 0.01]]
    assert out["last_sample"] == {"rows": 2, "kv_tokens": 154}


def test_a_reader_gets_the_samples_after_the_index_it_saw_and_the_window_bounds_them():
    log = StepLog(window=3)
    for i in range(5):
        log.record([10], [10 + i], [1], sampled=1, seconds=0.001 * (i + 1))
    first = log.since(0)
    assert first["steps"] == 5
    assert [s[2] for s in first["samples"]] == [0.003, 0.004, 0.005]  # the latest 3
    log.record([10], [15], [1], sampled=1, seconds=0.006)
    assert log.since(first["steps"])["samples"] == [[1, 16, 0.006]]
    assert log.since(log.steps)["samples"] == []
