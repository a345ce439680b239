"""Overlap scheduling: the same outputs as the engine without it, its text produced while the next
step computes, and every page accounted for (stop strings ending a request one step late)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pd.kvcache.cache_manager import KVCacheManager
from pd.protocol import GenerationOptions
from pd.worker.engine.engine import Engine
from pd.worker.engine.postprocess import OutputProcessor
from pd.worker.engine.scheduler import Scheduler
from pd.worker.model.sampler import SampleOutput
from tests.admit import admit

PAGE = 4
VOCAB = 26


class ChainRunner:
    """Samples a token that depends on the whole sequence so far (as a model's would), so a step
    that computed a wrong or stale input token gives different outputs. Each step takes a few ms
    and records which requests it computed."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []  # request ids per step

    def execute(self, batch) -> SampleOutput:
        time.sleep(0.003)
        self.steps.append([s.request_id for s in batch.seqs])
        tokens = []
        for seq, cached, n, sample in zip(
            batch.seqs, batch.num_cached, batch.num_new, batch.sample
        ):
            seen = seq.token_slice(0, cached + n)  # what the KV holds after this step
            assert len(seen) == cached + n, "a step computed a token it did not have"
            if sample:
                tokens.append(1 + (sum(seen) * 7 + len(seen)) % (VOCAB - 1))  # never 0 (EOS)
        return SampleOutput(tokens, [None] * len(tokens), [None] * len(tokens))


class Tok:
    eos_token_ids = frozenset({0})

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i % VOCAB) for i in ids)


REQUESTS = [
    # (prompt, options): ends by max_tokens, by a stop token, by stop strings, by the context
    (list(range(1, 9)), GenerationOptions(max_tokens=12)),
    (list(range(3, 14)), GenerationOptions(max_tokens=20, stop=("q",))),
    (list(range(2, 7)), GenerationOptions(max_tokens=30, stop=("ab", "zz", "x"))),
    (list(range(5, 25)), GenerationOptions(max_tokens=16, stop_token_ids=(9,))),
    ([7] * 30, GenerationOptions()),  # no max_tokens: runs into max_model_len
    (list(range(1, 4)), GenerationOptions(max_tokens=25, stop=("k",))),
]


async def run_all(
    overlap: bool,
) -> tuple[list[tuple[str, list[int], str | None]], Engine, ChainRunner]:
    runner = ChainRunner()
    scheduler = Scheduler(KVCacheManager(64, PAGE), chunk_size=16, max_running=8)
    engine = Engine(
        runner, scheduler, Tok(), max_model_len=48, max_waiting=16, overlap=overlap
    )
    emitted_while_busy = []
    emit = engine.postprocess.emit_text

    def recording_emit(pending):
        if pending:  # whether a step is in flight (submitted to the forward thread, not done)
            emitted_while_busy.append(bool(engine._step_seqs))
        return emit(pending)

    engine.postprocess.emit_text = recording_emit  # type: ignore[method-assign]
    engine.start()
    try:

        async def one(prompt, options):
            handle = engine.add(admit(prompt, options))
            text, ids, finish = "", [], None
            while finish is None:
                delta = await asyncio.wait_for(handle.queue.get(), 10)
                text, ids, finish = text + delta.text, ids + delta.token_ids, delta.finish_reason
            return text, ids, finish

        results = await asyncio.gather(*(one(p, o) for p, o in REQUESTS))
        while engine.scheduler.cache.num_used:  # a stopped request's pages wait for its step
            await asyncio.sleep(0.001)
        engine.scheduler.check_integrity()
        assert not engine.scheduler.running and not engine.handles
    finally:
        await engine.stop()
    runner.emitted_while_busy = emitted_while_busy  # type: ignore[attr-defined]
    return results, engine, runner


async def test_overlap_gives_the_same_outputs_and_overlaps():
    plain, _, plain_runner = await run_all(overlap=False)
    overlapped, _, runner = await run_all(overlap=True)
    assert overlapped == plain
    assert [finish for _, _, finish in plain] == [
        "length",
        "stop",
        "stop",
        "stop",
        "length",
        "stop",
    ]
    assert plain[3][1][-1] == 9  # the stop token ended it (its text is not shown)
    # Without overlap, text is never produced while a step computes; with it, almost always.
    assert not any(plain_runner.emitted_while_busy)  # type: ignore[attr-defined]
    busy = runner.emitted_while_busy  # type: ignore[attr-defined]
    assert sum(busy) > len(busy) // 2


async def test_a_stop_string_costs_one_extra_step_whose_token_is_dropped():
    _, _, plain = await run_all(overlap=False)
    _, _, overlapped = await run_all(overlap=True)
    stopped_by_string = "req-5"  # stop="k": ends on its text, found one step late with overlap
    plain_steps = sum(stopped_by_string in ids for ids in plain.steps)
    overlap_steps = sum(stopped_by_string in ids for ids in overlapped.steps)
    assert overlap_steps == plain_steps + 1


@pytest.mark.parametrize("overlap", [False, True])
async def test_abort_with_text_pending_frees_everything(overlap):
    runner = ChainRunner()
    scheduler = Scheduler(KVCacheManager(32, PAGE), chunk_size=16, max_running=8)
    engine = Engine(
        runner, scheduler, Tok(), max_model_len=64, max_waiting=8, overlap=overlap
    )
    engine.start()
    try:
        handles = [
            engine.add(admit(list(range(1, 6)), GenerationOptions(max_tokens=30)))
            for _ in range(3)
        ]
        await asyncio.wait_for(handles[0].queue.get(), 5)
        for h in handles:
            engine.abort(h)
        while engine.scheduler.cache.num_used:
            await asyncio.sleep(0.001)
        engine.scheduler.check_integrity()
        assert not engine.scheduler.has_work
    finally:
        await engine.stop()


@pytest.mark.parametrize("overlap", [False, True])
async def test_each_token_is_appended_once_in_order_and_only_those_the_client_gets(
    overlap, monkeypatch
):
    """`append_token` is where a request's grammar matcher will advance: it must see every token
    the client gets, in order, and no other (not the one a stop string's extra step samples)."""
    appended: dict[str, list[int]] = {}
    append = OutputProcessor.append_token

    def recording(self, handle, token, now):
        appended.setdefault(handle.seq.request_id, []).append(token)
        return append(self, handle, token, now)

    monkeypatch.setattr(OutputProcessor, "append_token", recording)
    results, _, _ = await run_all(overlap)
    assert [appended[f"req-{i}"] for i in range(len(REQUESTS))] == [ids for _, ids, _ in results]
