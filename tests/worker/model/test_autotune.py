"""`--dtype/--quantization auto`: the decision rule (autotune.py) on made-up timings, the cache
(kernel_cache.py), and what the worker does when a search is off or pinned (kernel_choice.py)."""

from __future__ import annotations

import math

import pytest
import torch

from pd.worker.model.tuning import kernel_cache
from pd.worker.model.tuning.autotune import (
    Candidate,
    Choice,
    candidates,
    choose,
    scores,
    search_batches,
)

F32, BF16 = "float32", "bfloat16"
C = Candidate
SAME = lambda c: True  # noqa: E731  (every format computes a row the same in any batch)


def test_candidates_cross_the_dimensions_that_are_auto_only():
    formats = ["none", "int8"]
    assert candidates("auto", "auto", formats) == [
        C(F32, "none"), C(F32, "int8"), C(BF16, "none"), C(BF16, "int8")
    ]  # fmt: skip
    assert candidates(BF16, "auto", formats) == [C(BF16, "none"), C(BF16, "int8")]
    assert candidates("auto", "int4", formats) == [C(F32, "int4"), C(BF16, "int4")]


def test_the_search_weighs_a_co_located_workers_steps_whatever_the_role():
    both = search_batches(512, 64)
    assert both == pytest.approx({1: 1 / 6, 8: 1 / 6, 32: 1 / 6, 512: 0.5})
    assert math.isclose(sum(both.values()), 1.0)
    assert search_batches(512, 4) == {1: 0.25, 4: 0.25, 512: 0.5}  # none past the running cap


def test_scores_are_the_geometric_mean_of_each_batchs_slowdown():
    ms = {C(F32, "none"): {1: 10.0, 32: 40.0}, C(F32, "int8"): {1: 5.0, 32: 80.0}}
    s = scores(ms, {1: 0.5, 32: 0.5})
    assert s[C(F32, "none")] == pytest.approx(math.sqrt(2))  # 2x at 1 row, fastest at 32
    assert s[C(F32, "int8")] == pytest.approx(math.sqrt(2))
    assert scores(ms, {1: 1.0})[C(F32, "int8")] == 1.0
    dropped = {**ms, C(BF16, "int4"): {1: 100.0}}  # not timed at 32: too slow at 1
    assert scores(dropped, {1: 0.5, 32: 0.5})[C(BF16, "int4")] == math.inf


def _ratios(table: dict[Candidate, float]):
    asked: list[Candidate] = []

    def ratio(c: Candidate) -> float:
        asked.append(c)
        return table[c]

    return ratio, asked


def test_the_fastest_within_the_perplexity_bound_wins_and_only_contenders_are_measured():
    ms = {
        C(F32, "none"): {1: 12.0},
        C(F32, "fbgemm-int8"): {1: 5.0},  # fastest, but over the bound
        C(F32, "int4"): {1: 6.0},
        C(BF16, "none"): {1: 16.0},
    }
    ratio, asked = _ratios({C(F32, "fbgemm-int8"): 1.7, C(F32, "int4"): 1.003})
    w = {1: 1.0}
    chosen, s, ratios = choose(ms, w, ratio, SAME)
    assert chosen == C(F32, "int4")
    assert asked == [C(F32, "fbgemm-int8"), C(F32, "int4")]  # bf16 none never measured
    assert ratios == {C(F32, "fbgemm-int8"): 1.7, C(F32, "int4"): 1.003}
    assert s[C(F32, "fbgemm-int8")] == 1.0


def test_the_reference_needs_no_perplexity_and_is_the_last_resort():
    ms = {C(F32, "none"): {1: 12.0}, C(F32, "int8"): {1: 8.0}}
    ratio, asked = _ratios({C(F32, "int8"): 1.5})
    chosen, _, _ = choose(ms, {1: 1.0}, ratio, SAME)
    assert chosen == C(F32, "none") and asked == [C(F32, "int8")]


def test_nothing_within_the_bound_is_refused_clearly():
    ms = {C(BF16, "int8"): {1: 8.0}}
    with pytest.raises(ValueError, match="pin --dtype float32 --quantization none"):
        choose(ms, {1: 1.0}, lambda c: 2.0, SAME)


def test_a_format_that_computes_a_row_otherwise_in_a_batch_is_passed_over():
    ms = {
        C(F32, "none"): {1: 12.0, 512: 300.0},
        C(F32, "int4@1+onednn-fp32"): {1: 5.0, 512: 150.0},  # a split: never auto's
        C(BF16, "onednn-bf16"): {1: 10.0, 512: 100.0},  # fastest single, rows differ from 33
        C(F32, "int4"): {1: 6.0, 512: 250.0},
    }
    w = {1: 0.5, 512: 0.5}
    asked: list[Candidate] = []

    def invariant(c: Candidate) -> bool:
        asked.append(c)
        return c.quantization in ("int4", "int8")

    ratio, ppl_asked = _ratios({C(F32, "int4"): 1.003})
    chosen, _, _ = choose(ms, w, ratio, invariant)
    assert chosen == C(F32, "int4")
    assert asked == [C(BF16, "onednn-bf16"), C(F32, "int4")]  # best first, once each
    assert ppl_asked == [C(F32, "int4")]  # the perplexity only of a format that could win
    # where no format computes rows the same at every batch: the best within the bound
    assert choose(ms, w, lambda c: 1.0, lambda c: False)[0] == C(BF16, "onednn-bf16")


def test_a_near_tie_between_dtypes_goes_to_the_preferred_one():
    ms = {
        C(F32, "int4"): {1: 10.0, 512: 300.0},
        C(BF16, "int4"): {1: 10.2, 512: 306.0},  # 2% slower: a tie
        C(BF16, "none"): {1: 40.0, 512: 400.0},
    }
    ok = lambda c: 1.0  # noqa: E731
    w = {1: 0.5, 512: 0.5}
    assert choose(ms, w, ok, SAME)[0] == C(F32, "int4")
    assert choose(ms, w, ok, SAME, prefer_dtype=BF16)[0] == C(BF16, "int4")
    # beyond DTYPE_TIE the faster dtype wins whatever the preference
    ms[C(BF16, "int4")] = {1: 12.0, 512: 360.0}
    assert choose(ms, w, ok, SAME, prefer_dtype=BF16)[0] == C(F32, "int4")
    # a preferred dtype whose candidates all fail the bound is not taken
    bad = lambda c: 2.0 if c.dtype == BF16 else 1.0  # noqa: E731
    ms[C(BF16, "int4")] = {1: 10.0, 512: 300.0}
    assert choose(ms, w, bad, SAME, prefer_dtype=BF16)[0] == C(F32, "int4")
    # nor one whose rows differ in a batch
    odd = lambda c: c.dtype == F32  # noqa: E731
    assert choose(ms, w, ok, odd, prefer_dtype=BF16)[0] == C(F32, "int4")


def test_a_choice_round_trips_through_json_and_says_what_chose_it():
    c = Choice(
        F32, "int4", "measured",
        ms={"float32/int4": {1: 5.81, 8: 15.8}, "bfloat16/int4": {1: 100.0}},
        scores={"float32/int4": 1.0, "bfloat16/int4": math.inf},
        perplexity_ratio={"float32/int4": 1.0034}, search_s=12.3,
    )  # fmt: skip
    import json

    back = Choice.from_dict(json.loads(json.dumps(c.as_dict())), "cache")
    assert back.dtype == F32 and back.quantization == "int4" and back.how == "cache"
    assert back.ms["float32/int4"] == {1: 5.81, 8: 15.8}
    assert back.scores["bfloat16/int4"] == math.inf
    line = c.summary()
    assert line.startswith("kernels float32/int4 (measured, search 12.3 s)")
    assert "perplexity x1.003" in line and "bfloat16/int4 dropped" in line


def _search_input(**changes):
    import dataclasses

    from pd.worker.model.tuning.search_input import SearchInput

    inp = SearchInput("auto", "auto", "auto", "cpu", 512, 64, 1, 1, 32, "x")
    return dataclasses.replace(inp, **changes)


def _cpu(flags=frozenset({"avx2", "fma"})):
    from pd.worker.model.tuning.cpu_info import CpuInfo

    return CpuInfo("AMD EPYC", flags, 2, "x86_64", "AVX2")


def test_the_cache_is_keyed_by_everything_measured(tmp_path):
    import dataclasses

    key = kernel_cache.cache_key(_search_input(), _cpu())
    assert kernel_cache.load(key, tmp_path) is None
    assert kernel_cache.store(key, {"dtype": F32}, tmp_path) is not None
    assert kernel_cache.load(key, tmp_path) == {"dtype": F32}
    other = kernel_cache.cache_key(_search_input(), _cpu(frozenset({"avx2"})))
    assert kernel_cache.load(other, tmp_path) is None  # another CPU
    assert kernel_cache.load({**key, "threads": 2}, tmp_path) is None
    # every field of the search's input is in the key
    for f in dataclasses.fields(_search_input()):
        value = getattr(_search_input(), f.name)
        changed = not value if isinstance(value, bool) else value * 2
        assert kernel_cache.cache_key(_search_input(**{f.name: changed}), _cpu()) != key, f.name
    for f in tmp_path.iterdir():
        f.write_text("{not json")
    assert kernel_cache.load(key, tmp_path) is None  # unreadable: a miss


def test_the_cache_dir_follows_pd_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    assert kernel_cache.cache_dir() == tmp_path / "kernels"


def test_pinned_or_switched_off_the_worker_measures_nothing(monkeypatch):
    from pd.worker.model.tuning.kernel_choice import resolve_kernels
    from tests.model_fixtures import default_checkpoint

    ckpt = default_checkpoint()
    kw = dict(config=ckpt.config, weights=ckpt.weights, encode=ckpt.tokenizer.encode)
    pinned = resolve_kernels(_search_input(dtype=F32, quantization="int8"), **kw)
    assert (pinned.dtype, pinned.quantization, pinned.how) == (F32, "int8", "pinned")
    monkeypatch.setenv("PD_KERNEL_SEARCH", "0")
    off = resolve_kernels(_search_input(), **kw)
    assert off.quantization == "none" and "PD_KERNEL_SEARCH=0" in off.how and not off.ms
    only = resolve_kernels(_search_input(dtype=BF16, device="cuda"), **kw)
    assert (only.dtype, only.quantization) == (BF16, "none")
    # an explicit --dtype never brings quantized weights: the checkpoint's, dense
    monkeypatch.setenv("PD_KERNEL_SEARCH", "1")
    f32 = resolve_kernels(_search_input(dtype=F32), **kw)
    assert (f32.dtype, f32.quantization, f32.head) == (F32, "none", "auto") and not f32.ms
    assert "--dtype float32" in f32.how


def test_a_search_times_distinct_layers_in_the_models_order_and_counts_their_bytes():
    from pd.worker.model.config import ModelConfig
    from pd.worker.model.tuning.kernel_search import (
        RandomWeights,
        layer_groups,
        linear_shapes,
        time_candidates,
    )

    cfg = ModelConfig("t", "llama", 256, 64, 128, 6, 4, 2, 16, 1e4, 1e-5, 128, True)
    shapes = linear_shapes(cfg, 1)
    per_layer = sum(s.out * s.inp * 4 for s in shapes if s.name != "lm_head")
    assert layer_groups(shapes) == 6  # every layer of a small model
    assert layer_groups(shapes, budget_bytes=2.5 * per_layer) == 2
    assert layer_groups(shapes, budget_bytes=1) == 1
    weights = RandomWeights.make(shapes, 2)
    assert len(weights.layers) == 2 and [s.name for s, _ in weights.layers[0]] == [
        "qkv", "o", "gate_up", "down"
    ]  # fmt: skip
    assert not torch.equal(weights.layers[0][0][1], weights.layers[1][0][1])  # distinct
    cands = [C(F32, "none"), C(F32, "int8"), C(F32, "int8@1+none")]
    ms, nbytes = time_candidates(cands, cfg, 1, [1, 32], 32, 32, reps=2)
    assert all(set(ms[c]) == {1, 32} and all(v > 0 for v in ms[c].values()) for c in cands)
    params = 6 * per_layer // 4 + cfg.vocab_size * cfg.hidden_size
    assert nbytes[C(F32, "none")] == params * 4  # 6 layers and the head, fp32
    # a split holds both formats
    assert nbytes[C(F32, "int8@1+none")] == nbytes[C(F32, "none")] + nbytes[C(F32, "int8")]
    # memory for one candidate at a time: timed in turn, the same figures' keys and bytes
    alone, nbytes_alone = time_candidates(cands, cfg, 1, [1, 32], 32, 32, 2, memory_bytes=1)
    assert {c: set(t) for c, t in alone.items()} == {c: set(t) for c, t in ms.items()}
    assert nbytes_alone == nbytes


def test_smooth_int8_replaces_the_plain_dynamic_int8_layers_but_not_heads():
    from pd.worker.model.config import ModelConfig
    from pd.worker.model.tuning.kernel_choice import layer_formats
    from pd.worker.model.tuning.kernel_search import time_candidates

    plain = ["none", "int4", "fbgemm-int8", "onednn-int8", "onednn-fp32"]
    assert layer_formats(plain) == plain
    assert layer_formats([*plain, "smooth-int8"]) == ["none", "int4", "onednn-fp32", "smooth-int8"]
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch on this machine has no FBGEMM quantized engine")
    # timed on random weights with a flat calibration, every kind of layer smoothed
    cfg = ModelConfig("t", "llama", 256, 64, 128, 6, 4, 2, 16, 1e4, 1e-5, 128, True)
    cands = [C(F32, "smooth-int8"), C(F32, "int4@1+smooth-int8")]
    ms, nbytes = time_candidates(cands, cfg, 1, [1, 32], 32, 32, reps=2)
    assert all(set(ms[c]) == {1, 32} and all(v > 0 for v in ms[c].values()) for c in cands)
    assert nbytes[cands[0]] < nbytes[cands[1]]


def test_a_candidate_far_behind_at_a_batch_is_not_timed_at_the_larger_ones(monkeypatch):
    from pd.worker.model.config import ModelConfig
    from pd.worker.model.tuning import kernel_search

    cfg = ModelConfig("t", "llama", 256, 64, 128, 6, 4, 2, 16, 1e4, 1e-5, 128, True)
    slow = C(F32, "int8")
    real = kernel_search.BuiltCandidate.calls

    def calls(self, rows, prefill_rows, gen):  # int8's layers 20x slower past one row
        body, head, scale = real(self, rows, prefill_rows, gen)
        return body, head, scale * (20 if self.candidate == slow and rows > 1 else 1)

    monkeypatch.setattr(kernel_search.BuiltCandidate, "calls", calls)
    rows = [1, 8, 32, 64]
    ms, _ = kernel_search.time_candidates([C(F32, "none"), slow], cfg, 1, rows, 64, 32)
    assert set(ms[C(F32, "none")]) == set(rows)
    assert set(ms[slow]) == {1, 8, 32}  # found far behind at 32 rows, left out after


def test_the_drop_rule_spares_the_batches_where_time_is_bytes_read():
    from pd.worker.model.tuning.kernel_search import DropRule
    from pd.worker.model.tuning.knobs import DROP_FACTOR

    rule = DropRule([1, 8, 32, 512])
    assert rule.go_on(1, 8.0) and rule.go_on(8, 11.0)  # the first candidate sets the pace
    # bf16 dense reads 4x int4's bytes: 5x slower at one row, but timed on (fastest at 512)
    assert rule.go_on(1, 42.0) and rule.go_on(8, 63.0)  # 5.7x at 8 rows: spared too
    assert rule.go_on(32, 27.0) and not rule.go_on(32, 27.0 * DROP_FACTOR * 1.01)
    assert rule.go_on(512, 60.0) and rule.go_on(512, 240.0) and not rule.go_on(512, 241.0)
    # a search whose smallest batch is a prefill chunk spares that one
    assert DropRule([512]).go_on(512, 1.0) and DropRule([512]).go_on(512, 1e9)


def test_the_lm_head_is_scored_by_the_step_it_makes_and_must_beat_the_layers_own():
    from pd.worker.model.tuning.autotune import choose_head

    rule = C(BF16, "int8")
    ms = {
        rule: {1: 2.0, 8: 2.4, 512: 2.0},  # 512: the one sampled row of a prefill chunk
        C(BF16, "int4"): {1: 0.9, 8: 1.5, 512: 0.9},  # fastest, over the bound
        C(BF16, "fbgemm-int8"): {1: 1.0, 8: 1.2, 512: 1.0},  # a row differs in a batch
        C(BF16, "onednn-fp32"): {1: 1.2, 8: 1.4, 512: 1.2},
        C(BF16, "none"): {1: 2.6, 8: 2.6, 512: 2.6},
    }
    step = {1: 8.0, 8: 16.0, 512: 300.0}  # the layers' step with the rule's head
    w = {1: 0.25, 8: 0.25, 512: 0.5}
    table = {C(BF16, "int4"): 1.08, C(BF16, "fbgemm-int8"): 1.001, C(BF16, "onednn-fp32"): 1.0}
    ratio, asked = _ratios(table)
    invariant = lambda c: c.quantization != "fbgemm-int8"  # noqa: E731
    head, s, ratios = choose_head(ms, step, w, ratio, rule, invariant)
    assert head == C(BF16, "onednn-fp32")
    assert asked == [C(BF16, "int4"), C(BF16, "onednn-fp32")]  # fbgemm-int8 never judged
    assert rule not in ratios  # the rule passed with the layers
    # scored by the step (the layers' 6 / 13.6 / 298 ms past the rule's head, plus its own)
    # against the fastest head's at each batch (int4 at 1 and 512 rows, fbgemm-int8 at 8)
    assert s[head] == pytest.approx(
        math.exp(
            0.25 * math.log(7.2 / 6.9)
            + 0.25 * math.log(15.0 / 14.8)
            + 0.5 * math.log(299.2 / 298.9)
        ),
        rel=1e-9,
    )
    # a head no better than the rule by HEAD_GAIN leaves the rule
    flat = {rule: {1: 2.0}, C(BF16, "onednn-bf16"): {1: 1.99}}
    assert choose_head(flat, {1: 8.0}, {1: 1.0}, lambda c: 1.0, rule, SAME)[0] == rule
    # nothing else passes: the rule
    assert choose_head(ms, step, w, lambda c: 2.0, rule, SAME)[0] == rule
    # a rule whose rows differ in a batch gives way to any head that passes, however slow
    odd = lambda c: c != rule  # noqa: E731
    assert choose_head(ms, step, w, lambda c: 1.0 if c.quantization == "none" else 2.0, rule, odd)[
        0
    ] == C(BF16, "none")


def test_workers_beside_each_other_wait_for_one_search(tmp_path):
    import threading
    import time

    key = kernel_cache.cache_key(_search_input(), _cpu())
    order: list[str] = []

    def second() -> None:
        with kernel_cache.locked(key, tmp_path):
            order.append("second reads " + str(kernel_cache.load(key, tmp_path)))

    with kernel_cache.locked(key, tmp_path):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)  # the second is waiting now
        order.append("first stores")
        kernel_cache.store(key, {"dtype": F32}, tmp_path)
    t.join(10)
    assert order == ["first stores", "second reads {'dtype': 'float32'}"]


def test_a_choice_with_its_head_round_trips_and_says_it():
    import json

    c = Choice(
        BF16, "int4", "measured", ms={"bfloat16/int4": {1: 6.0}}, scores={"bfloat16/int4": 1.0},
        head="fbgemm-int8@8+int8", head_ms={"fbgemm-int8@8+int8": {1: 1.0}, "int8": {1: 2.1}},
        head_scores={"fbgemm-int8@8+int8": 1.0, "int8": 1.12},
        head_perplexity_ratio={"fbgemm-int8@8+int8": 1.0061},
    )  # fmt: skip
    back = Choice.from_dict(json.loads(json.dumps(c.as_dict())), "cache")
    assert back.head == "fbgemm-int8@8+int8" and back.head_ms["int8"] == {1: 2.1}
    assert back.head_perplexity_ratio == {"fbgemm-int8@8+int8": 1.0061}
    line = c.summary()
    assert line.startswith("kernels bfloat16/int4, LM head fbgemm-int8@8+int8 (measured")
    assert "LM heads: fbgemm-int8@8+int8 x1.00 (perplexity x1.006); int8 x1.12" in line


def test_a_dynamic_int8_head_is_judged_as_it_runs():
    from pd.worker.model.kernels import DynamicInt8Linear
    from pd.worker.model.tuning.kernel_search import ChunkedLinear

    torch.manual_seed(0)
    w = torch.randn(64, 32)
    x = torch.randn(9, 32)
    x[0] *= 50  # one row far larger: quantized together, the others lose their bits
    layer = DynamicInt8Linear(w, None, "fbgemm")
    exact = x @ w.t()
    whole = (layer(x) - exact)[1:].abs().max()
    chunked = ChunkedLinear(layer, 1)
    per_row = (chunked(x) - exact)[1:].abs().max()
    assert per_row < whole / 4  # a row at a time keeps each row's own scale
    assert torch.equal(chunked(x)[3:4], layer(x[3:4]))  # the same kernel, a call per chunk
    assert chunked.nbytes == layer.nbytes


def test_the_judge_weighs_a_split_heads_small_half_at_its_rows_on_the_real_model():
    from pd.worker.model.tuning.kernel_search import PerplexityJudge
    from pd.worker.model.tuning.perplexity import shipped_text
    from tests.model_fixtures import default_checkpoint

    ckpt = default_checkpoint()
    ids = ckpt.tokenizer.encode(shipped_text())[:160]
    judge = PerplexityJudge(ckpt.config, ckpt.weights, ids, 1, 32)
    layers = C(F32, "none")
    whole = judge.head_ratio(layers, C(F32, "fbgemm-int8"))  # 159 rows quantized together
    split = judge.head_ratio(layers, C(F32, "fbgemm-int8@1+none"))  # a row a call, dense above
    assert split < whole and split < 1.02  # as decode runs it: each row its own scale
    assert judge.head_ratio(layers, C(F32, "none")) == pytest.approx(1.0, abs=1e-4)
    assert len(judge._hiddens) == 1  # the layers ran once for every head
    # a weight-only half is judged once, whatever its rows
    judge.head_ratio(layers, C(F32, "int8@8+none"))
    assert (F32, "none", "int8", None) in judge._head_ratios
    assert not any(k[2] == "int8" and k[3] is not None for k in judge._head_ratios)


def test_a_cached_choice_with_bad_values_is_refused_and_measured_again():
    """A cache file edited or written by another version: a format that is not a candidate
    here, an unknown head, a negative time. Each is a ValueError (`resolve_kernels` measures
    again with a warning), never a worker that fails to start."""
    import json

    from pd.worker.model.tuning.kernel_choice import _checked

    cands = [Candidate(F32, "none"), Candidate(F32, "int4")]
    good = Choice(F32, "int4", "measured", ms={"float32/int4": {1: 5.0}}, head="auto")
    round_trip = Choice.from_dict(json.loads(json.dumps(good.as_dict())), "cache")
    assert _checked(round_trip, cands, ["none", "int4"], "auto") is round_trip
    for bad, needle in [
        (Choice(F32, "int3", "cache"), "not a candidate"),
        (Choice("float64", "int4", "cache"), "not a candidate"),
        (Choice(F32, "int4", "cache", head="q9"), "LM head format"),
        (Choice(F32, "int4", "cache", ms={"float32/int4": {1: -1.0}}), "step time"),
    ]:
        with pytest.raises(ValueError, match=needle):
            _checked(bad, cands, ["none", "int4"], "auto")


def test_the_answer_judge_is_asked_last_and_a_candidate_it_refuses_is_passed_over():
    from pd.worker.model.tuning.autotune import choose_head

    ms = {
        C(BF16, "int4"): {1: 5.0, 512: 200.0},  # fastest: its answers fail
        C(F32, "int4"): {1: 6.0, 512: 250.0},
        C(F32, "none"): {1: 20.0, 512: 300.0},
    }
    w = {1: 0.5, 512: 0.5}
    judged: list[Candidate] = []

    def accepts(c: Candidate) -> bool:
        judged.append(c)
        return c != C(BF16, "int4")

    ok = lambda c: 1.0  # noqa: E731
    over = lambda c: 2.0 if c == C(F32, "int4") else 1.0  # noqa: E731
    assert choose(ms, w, ok, SAME, accepts=accepts)[0] == C(F32, "int4")
    assert judged == [C(BF16, "int4"), C(F32, "int4")]  # best first, once each
    judged.clear()
    # a candidate over the perplexity bound is never shown to the answer judge
    assert choose(ms, w, over, SAME, accepts=accepts)[0] == C(F32, "none")
    assert C(F32, "int4") not in judged
    # the LM head: the rule's answers fail, so the best head whose answers pass wins
    rule = C(F32, "int8")
    heads = {rule: {1: 2.0}, C(F32, "onednn-bf16"): {1: 2.5}, C(F32, "none"): {1: 3.0}}
    no_rule = lambda c: c != rule  # noqa: E731
    assert choose_head(heads, {1: 8.0}, {1: 1.0}, ok, rule, SAME, accepts=no_rule)[0] == C(
        F32, "onednn-bf16"
    )
    assert choose_head(heads, {1: 8.0}, {1: 1.0}, ok, rule, SAME)[0] == rule


def test_within_the_faithful_tie_the_answers_closest_to_fp32s_win():
    ms = {
        C(F32, "int4"): {1: 10.0, 512: 300.0},  # fastest
        C(F32, "int4-fp32"): {1: 12.0, 512: 270.0},  # 4% behind: fp32's own answers
        C(F32, "onednn-fp32"): {1: 30.0, 512: 250.0},  # 58% behind: out of the tie
        C(F32, "int8"): {1: 9.0, 512: 400.0},  # within the tie, refused by the judge
    }
    w = {1: 0.5, 512: 0.5}
    agree = {C(F32, "int4"): 28.0, C(F32, "int4-fp32"): 32.0, C(F32, "onednn-fp32"): 32.0}
    asked: list[Candidate] = []

    def agreement(c: Candidate) -> float:
        asked.append(c)
        return agree[c]

    def accepts(c: Candidate) -> bool:
        return c != C(F32, "int8")

    ok = lambda c: 1.0  # noqa: E731
    assert choose(ms, w, ok, SAME, accepts=accepts)[0] == C(F32, "int4")
    chosen = choose(ms, w, ok, SAME, accepts=accepts, agreement=agreement)[0]
    assert chosen == C(F32, "int4-fp32")
    assert C(F32, "onednn-fp32") not in asked and C(F32, "int8") not in asked
    # equal agreement: the better score
    agree[C(F32, "int4")] = 32.0
    assert choose(ms, w, ok, SAME, accepts=accepts, agreement=agreement)[0] == C(F32, "int4")
