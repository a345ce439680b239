"""Workloads repeat per seed and give the asked lengths in the model's tokens."""

from __future__ import annotations

import dataclasses

import pytest

from pd.bench.serve.workloads import WorkloadConfig, build


def test_same_seed_same_requests_other_seed_others(token_text):
    cfg = WorkloadConfig("random", num_requests=4, input_len=40, output_len=8, range_ratio=0.5)
    a, b = build(cfg, token_text), build(cfg, token_text)
    c = build(dataclasses.replace(cfg, seed=1), token_text)
    assert [j.turns for j in a] == [j.turns for j in b]
    assert [j.turns[0].prompt for j in a] != [j.turns[0].prompt for j in c]


def test_random_lengths_are_exact_and_spread(token_text):
    jobs = build(
        WorkloadConfig("random", num_requests=20, input_len=100, range_ratio=0.5), token_text
    )
    lengths = [token_text.count(j.turns[0].prompt) for j in jobs]
    assert lengths == [j.turns[0].input_len for j in jobs]
    assert all(50 <= n <= 150 for n in lengths) and len(set(lengths)) > 5
    assert all(j.ignore_eos and not j.chat for j in jobs)
    fixed = build(WorkloadConfig("random", num_requests=3, input_len=77, output_len=5), token_text)
    assert [token_text.count(j.turns[0].prompt) for j in fixed] == [77] * 3
    assert {j.turns[0].max_tokens for j in fixed} == {5}


def test_shared_prefix_shares_one_system_prompt(token_text):
    jobs = build(WorkloadConfig("shared-prefix", num_requests=5), token_text)
    systems = {j.turns[0].system for j in jobs}
    assert len(systems) == 1 and token_text.count(systems.pop()) == 1500
    users = [j.turns[0].user for j in jobs]
    assert len(set(users)) == 5 and all(token_text.count(u) == 32 for u in users)
    assert not any(j.ignore_eos for j in jobs)


def test_multi_turn_conversations(token_text):
    jobs = build(WorkloadConfig("multi-turn"), token_text)
    assert len(jobs) == 8 and all(len(j.turns) == 4 for j in jobs)
    assert len({j.room for j in jobs}) == 8
    assert len({j.turns[0].system for j in jobs}) == 8  # each its own system prompt
    assert all(len({t.system for t in j.turns}) == 1 for j in jobs)
    assert token_text.count(jobs[0].turns[0].system) == 1000
    assert token_text.count(jobs[0].turns[1].user) == 50
    assert {t.max_tokens for j in jobs for t in j.turns} == {64}
    assert len(build(WorkloadConfig("multi-turn", num_requests=12), token_text)) == 3


def test_mixed_has_periodic_long_prompts(token_text):
    jobs = build(WorkloadConfig("mixed", num_requests=16, long_every=4), token_text)
    kinds = [j.meta["kind"] for j in jobs]
    assert kinds == ["short", "short", "short", "long"] * 4
    long = [j for j in jobs if j.meta["kind"] == "long"]
    assert token_text.count(long[0].turns[0].prompt) == 1024
    assert all(j.ignore_eos for j in jobs)


def test_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        build(WorkloadConfig("nope"), None)  # type: ignore[arg-type]
