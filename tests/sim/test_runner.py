"""SimulatedRunner: deterministic word tokens (the same on one worker, on P then D, and after a
continuation), token rules obeyed, logprobs filled, steps as long as the cost model says (scaled),
and a KV pool of the profile's real page sizes that holds no memory."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from pd.protocol import GenerationOptions
from pd.sim import CostModel, parse_profile
from pd.worker.simulated.runner import SimulatedRunner
from pd.worker.simulated.tokens import CHOSEN_LOGPROB
from pd.worker.checkpoint import default_model_path, load_tokenizer
from pd.worker.disagg.contract import KVContract, kv_pool_of, runtime_format, runtime_report
from pd.worker.engine.batch import ScheduledBatch
from pd.worker.engine.request import Sequence

PROMPT = [28, 1010, 2049, 3113, 77, 901, 4242, 17, 5000, 12, 600, 31, 44, 9, 1200, 13, 88]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def make(tokenizer, profile: str = "llama-3.1-8b:h100", scale: float = 1e-3, **kw):
    kw = {"page_size": 16, "num_pages": 64, "max_model_len": 4096, **kw}
    return SimulatedRunner(parse_profile(profile), tokenizer, time_scale=scale, **kw)


def seq(prompt=PROMPT, output=(), rules=None, **options) -> Sequence:
    s = Sequence("r", list(prompt), GenerationOptions(**options), max_tokens=1000, rules=rules)
    s.output_ids = list(output)
    return s


def run(runner, seqs, news=None) -> list[int]:
    """One step: each seq computes `news[i]` tokens (default: all it has not computed) and
    samples; the cached part is the rest."""
    news = news or [s.num_tokens - s.num_computed for s in seqs]
    cached = [s.num_tokens - n for s, n in zip(seqs, news)]
    batch = ScheduledBatch(list(seqs), cached, list(news), [True] * len(seqs))
    return runner.execute(batch).token_ids


def generate(runner, s: Sequence, n: int) -> list[int]:
    """n tokens of `s` one step at a time (its first step prefills what it has)."""
    out = []
    for _ in range(n):
        (t,) = run(runner, [s])
        s.output_ids.append(t)
        s.num_computed = s.num_tokens - 1
        out.append(t)
    return out


def test_tokens_are_words_the_same_every_run_and_never_special(tokenizer):
    a = generate(make(tokenizer), seq(), 48)
    b = generate(make(tokenizer), seq(), 48)  # another runner, as another process
    assert a == b
    assert generate(make(tokenizer), seq(prompt=[*PROMPT, 5]), 48) != a
    special = set(tokenizer.backend.get_added_tokens_decoder()) | set(tokenizer.eos_token_ids)
    assert not special & set(a)
    text = tokenizer.decode(a)
    assert re.fullmatch(r"( [a-z]{3,8})+", text), text
    assert len(set(a)) > 40  # not one word over and over


def test_the_same_ids_on_p_then_d_after_a_continuation_and_beside_other_requests(tokenizer):
    one = generate(make(tokenizer), seq(), 12)  # a co-located worker
    (first,) = run(make(tokenizer), [seq()])  # P samples position 0
    d = seq(output=[first])  # D: the pulled request, P's token appended
    d.num_computed = len(PROMPT)
    assert [first, *generate(make(tokenizer), d, 11)] == one
    cont = seq(output=one[:5])  # a migration: prompt + 5 given ids, prefilled anew
    assert generate(make(tokenizer), cont, 7) == one[5:]
    # Beside other requests, as a prefill chunk or a decode row: the same ids.
    runner = make(tokenizer)
    other, again = seq(prompt=[3, 4, 5, 6]), seq(output=one[:3])
    again.num_computed = len(PROMPT) + 2
    assert run(runner, [other, again], [4, 1])[1] == one[3]
    # A seed makes another stream (n > 1's choices with seed + i), and always the same one.
    s7 = generate(make(tokenizer), seq(seed=7), 12)
    assert s7 != one and s7 == generate(make(tokenizer), seq(seed=7), 12)


class Allow:
    """Token rules allowing only `ids` (the engine's TokenRules fill the same bitmask rows)."""

    def __init__(self, ids) -> None:
        self.ids = list(ids)

    def fill_mask(self, row: np.ndarray, output_ids) -> None:
        row[:] = 0
        bits = row.view(np.uint32)
        for t in self.ids:
            bits[t >> 5] |= np.uint32(1 << (t & 31))


def test_token_rules_are_obeyed(tokenizer):
    runner = make(tokenizer)
    words = runner.picker.words
    unconstrained = generate(make(tokenizer), seq(), 8)
    few = [w for w in words[:50] if w not in unconstrained]
    assert set(generate(runner, seq(rules=Allow(few)), 8)) <= set(few)
    digits = [tokenizer.encode(str(d))[0] for d in range(10)]  # allowed ids that are not words
    assert set(generate(runner, seq(rules=Allow(digits)), 8)) <= set(digits)
    (accent,) = tokenizer.encode("é")  # allowed too, but not printable ASCII: never chosen
    assert set(generate(runner, seq(rules=Allow([accent, *digits])), 8)) <= set(digits)
    assert run(runner, [seq(rules=Allow([accent]))]) == [accent]
    eos = tokenizer.eos_token_id
    assert run(runner, [seq(rules=Allow([eos]))]) == [eos]  # a complete grammar: only EOS left
    # Words and EOS allowed: a word (the model never stops on its own).
    assert run(runner, [seq(rules=Allow([eos, *few]))])[0] in few


def test_logprobs_and_prompt_logprobs_are_filled(tokenizer):
    runner = make(tokenizer)
    s = seq(logprobs=True, top_logprobs=3, prompt_logprobs=2)
    batch = ScheduledBatch([s], [0], [10], [False])  # a first chunk: no sample yet
    out = runner.execute(batch)
    assert out.token_ids == [] and out.prompt_logprobs[0][:2] == (0, 0)
    entries = out.prompt_logprobs[0][2]
    assert len(entries) == 10 and entries[0][:2] == (CHOSEN_LOGPROB, 1)
    assert entries[0][2][0] == (PROMPT[1], CHOSEN_LOGPROB) and len(entries[0][2]) == 2
    batch = ScheduledBatch([s], [10], [len(PROMPT) - 10], [True])  # the last chunk samples
    out = runner.execute(batch)
    assert len(out.prompt_logprobs[0][2]) == len(PROMPT) - 1 - 10  # up to the last prompt token
    (t,) = out.token_ids
    assert out.logprobs == [CHOSEN_LOGPROB]
    top = out.top_logprobs[0]
    assert top is not None and top[0] == (t, CHOSEN_LOGPROB) and len(top) == 3
    values = [v for _, v in top]
    assert len({i for i, _ in top}) == 3 and values[0] > values[1] > values[2]  # most likely first


def test_n_choices_riding_on_a_row_get_their_own_tokens(tokenizer):
    runner = make(tokenizer)
    parent, child = seq(seed=3), seq(seed=4)
    batch = ScheduledBatch([parent], [0], [len(PROMPT)], [True], riders=[(0, child)])
    assert runner.execute(batch).token_ids == [
        run(make(tokenizer), [seq(seed=3)])[0],
        run(make(tokenizer), [seq(seed=4)])[0],
    ]


def test_a_step_takes_its_modeled_time_scaled(tokenizer):
    profile = "llama-3.1-70b:h100:tp4"
    runner = make(tokenizer, profile, scale=2.0, num_pages=128)
    s = seq(prompt=list(range(100, 612)))
    modeled = CostModel(parse_profile(profile)).step([(0, 512)], 1).total_s
    t0 = time.perf_counter()
    run(runner, [s])
    took = time.perf_counter() - t0
    assert 2 * modeled <= took < 2 * modeled + 0.05, (took, modeled)
    stats = runner.stats()
    assert stats.steps == 1 and stats.modeled_s == pytest.approx(modeled)
    assert stats.real_s == pytest.approx(took, abs=0.005)
    assert 0 <= stats.overshoot_max_s < 0.05
    assert runner.describe()["profile"] == "llama-3.1-70b:h100:tp4:rdma-400g"


def test_the_kv_pool_has_real_page_sizes_and_holds_no_memory(tokenizer):
    runner = make(tokenizer, "llama-3.1-70b:h100:tp4", num_pages=1000)
    pool = kv_pool_of(runner)
    # 80 layers x K/V x 2 KV heads a rank x 16 tokens x 128 dims x 2 bytes.
    assert pool.slot_bytes == runner.kv_page_bytes == 80 * 2 * 2 * 16 * 128 * 2
    assert pool.tp_size == 4 and [r.head_start for r in pool.ranks] == [0, 2, 4, 6]
    assert (
        pool.slot_bytes * pool.tp_size
        == 16 * parse_profile("llama-3.1-70b:h100").model.kv_bytes_per_token
    )
    other = kv_pool_of(make(tokenizer, "llama-3.1-70b:h100:tp4", num_pages=1000))
    spans = sorted(
        (r.base_addr, r.base_addr + p.region_bytes) for p in (pool, other) for r in p.ranks
    )
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:]))  # never overlapping
    # More ranks than KV heads: heads replicate over consecutive ranks.
    wide = kv_pool_of(make(tokenizer, "llama-3.1-8b:h100:tp16"))
    assert wide.split is not None and wide.split.heads == 1
    assert [r.head_start for r in wide.ranks][:4] == [0, 0, 1, 1]


def test_workers_of_one_model_pair_on_any_device_and_tp_and_others_do_not(tokenizer):
    p = KVContract.of(make(tokenizer, "llama-3.1-8b:h100"))
    assert KVContract.of(make(tokenizer, "llama-3.1-8b:h200:tp2")) == p
    assert KVContract.of(make(tokenizer, "qwen3-32b:h100:tp2")) != p
    assert p.dtype == "bfloat16"
    runtime = runtime_format(make(tokenizer))
    assert runtime["attention"] == "simulated" and runtime["compute_dtype"] == "bfloat16"
    assert runtime_report(make(tokenizer))["checkpoint"].startswith("sim:")
