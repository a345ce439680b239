"""The engine's part in the prompt's logprobs, over integers: a request that asks skips the
prefix cache's match (a cached page has no logits) but still caches its pages; entries are
accumulated chunk by chunk and replaced after a preemption; max_tokens 0 ends at the prompt."""

from __future__ import annotations

from pd.kvcache.cache_manager import KVCacheManager
from pd.protocol import GenerationOptions
from pd.worker.engine.batch import ScheduledBatch
from pd.worker.engine.postprocess import OutputProcessor
from pd.worker.engine.request import RequestHandle, SeqStatus, Sequence
from pd.worker.engine.scheduler import Scheduler
from pd.worker.model.sampler import SampleOutput
from pd.worker.text.detokenizer import IncrementalDetokenizer
from pd.worker.text.stop import StopChecker

PAGE = 4


class Tok:
    eos_token_ids = frozenset({0})

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def seq(name: str, prompt: list[int], prompt_logprobs: int | None = None) -> Sequence:
    options = GenerationOptions(max_tokens=2, prompt_logprobs=prompt_logprobs)
    return Sequence(name, prompt, options, 2)


def run(s: Scheduler, q: Sequence) -> list[ScheduledBatch]:
    s.add(q)
    batches = []
    while len(q.output_ids) < q.max_tokens:
        batch = s.schedule()
        s.advance(batch)
        for x in batch.sampled:
            x.output_ids.append(7)
        s.check_integrity()
        batches.append(batch)
    s.finish(q, "length")
    s.check_integrity()
    return batches


def test_a_request_for_prompt_logprobs_skips_the_cache_match_but_caches_its_pages():
    s = Scheduler(KVCacheManager(32, PAGE), chunk_size=64, max_running=4)
    prompt = list(range(1, 19))
    run(s, seq("a", prompt))
    again = seq("b", prompt, prompt_logprobs=1)
    first = run(s, again)[0]
    assert first.num_cached == [0] and first.num_new == [18]  # every position computed
    assert again.num_cached_tokens == 0
    cached = s.cache.num_cached
    plain = seq("c", prompt)
    assert run(s, plain)[0].num_cached == [16]  # the cache still serves those who do not ask
    fresh = Scheduler(KVCacheManager(32, PAGE), chunk_size=64, max_running=4)
    run(fresh, seq("d", prompt, prompt_logprobs=0))  # one that asks caches its pages too
    assert fresh.cache.num_cached == cached == 4
    assert run(fresh, seq("e", prompt))[0].num_cached == [16]


def test_entries_accumulate_per_chunk_and_are_replaced_after_a_preemption():
    post = OutputProcessor(Tok(), max_model_len=64, metrics=None)
    q = seq("a", list(range(1, 9)), prompt_logprobs=0)
    batch = ScheduledBatch([q], [0], [4], [False])

    def entries(first: int, n: int, lp: float) -> SampleOutput:
        return SampleOutput([], prompt_logprobs=[(0, first, [(lp, 1, [])] * n)])

    post.accept_prompt_logprobs(batch, entries(0, 4, -1.0))
    post.accept_prompt_logprobs(batch, entries(4, 3, -2.0))
    assert [e[0] for e in q.prompt_logprobs] == [-1.0] * 4 + [-2.0] * 3
    post.accept_prompt_logprobs(batch, entries(0, 4, -3.0))  # recomputed from the start
    assert [e[0] for e in q.prompt_logprobs] == [-3.0] * 4
    q.status = SeqStatus.FINISHED  # aborted while the step ran: nothing added
    post.accept_prompt_logprobs(batch, entries(4, 3, -2.0))
    assert len(q.prompt_logprobs) == 4


def test_max_tokens_0_finishes_at_the_prompt_with_no_token():
    post = OutputProcessor(Tok(), max_model_len=64, metrics=None)
    options = GenerationOptions(max_tokens=0, prompt_logprobs=1)
    q = Sequence("a", [1, 2, 3], options, 0, status=SeqStatus.RUNNING)
    handle = RequestHandle(q, IncrementalDetokenizer(Tok()), StopChecker(()))
    pending, finished = post.accept_tokens([handle], SampleOutput([5], [None], [None]))
    assert not pending and q.output_ids == []
    assert [(f.last.finish_reason, f.last.token_ids, f.last.text) for f in finished] == [
        ("length", [], "")
    ]
