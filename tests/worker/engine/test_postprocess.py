"""Postprocess alone: it appends tokens and returns the requests that finished, with their reason
and last delta; it never frees pages, pops handles or queues a finished request's last delta
(the engine ends requests). Every stop check, once, on both paths (a step's rows, P's first
token on D)."""

from __future__ import annotations

from pd.protocol import GenerationOptions
from pd.worker.engine.postprocess import OutputProcessor
from pd.worker.engine.request import RequestHandle, SeqStatus, Sequence
from pd.worker.model.sampler import SampleOutput
from pd.worker.text.detokenizer import IncrementalDetokenizer
from pd.worker.text.stop import StopChecker

EOS = 0


class Tok:
    eos_token_ids = frozenset({EOS})

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def handle(rid: str, options: GenerationOptions, prompt_len: int = 3) -> RequestHandle:
    seq = Sequence(rid, list(range(1, prompt_len + 1)), options, options.max_tokens or 100)
    seq.status = SeqStatus.RUNNING
    return RequestHandle(seq, IncrementalDetokenizer(Tok()), StopChecker(options.stop))


def step(post: OutputProcessor, rows: list[tuple[RequestHandle | None, int]]):
    out = SampleOutput([t for _, t in rows], [None] * len(rows), [None] * len(rows))
    return post.accept_tokens([h for h, _ in rows], out)


def test_a_step_returns_what_its_tokens_ended_and_leaves_the_rest_for_emit_text():
    post = OutputProcessor(Tok(), max_model_len=8, metrics=None)
    stop_id = handle("stop-id", GenerationOptions(max_tokens=9, stop_token_ids=(9,)))
    eos = handle("eos", GenerationOptions(max_tokens=9))
    ignore_eos = handle("ignore-eos", GenerationOptions(max_tokens=9, ignore_eos=True))
    length = handle("length", GenerationOptions(max_tokens=1))
    context = handle("context", GenerationOptions(max_tokens=9), prompt_len=7)  # 7 + 1 = 8
    text = handle("text", GenerationOptions(max_tokens=9, stop=("c",)))
    aborted = handle("aborted", GenerationOptions(max_tokens=9))
    aborted.seq.status = SeqStatus.FINISHED  # ended while the step ran
    rows = [
        (stop_id, 9), (eos, EOS), (ignore_eos, EOS), (length, 3), (context, 4), (text, 2),
        (aborted, 5), (None, 5),
    ]  # fmt: skip
    pending, finished = step(post, rows)
    ended = {f.handle.seq.request_id: f.last for f in finished}
    assert {rid: d.finish_reason for rid, d in ended.items()} == {
        "stop-id": "stop", "eos": "stop", "length": "length", "context": "length",
    }  # fmt: skip
    assert ended["stop-id"].text == "" and ended["length"].text == "d"  # a stop id is not shown
    assert [p.handle.seq.request_id for p in pending] == ["ignore-eos", "text"]
    assert aborted.seq.output_ids == []  # nothing appended to a request that ended
    # Postprocess never ends a request itself: no page freed, nothing queued for the finished.
    for h in (stop_id, eos, length, context):
        assert h.seq.status is SeqStatus.RUNNING and h.queue.empty()
    # Phase 2: the text; a stop string ends "text" ("c" is token 2), not "ignore-eos".
    (done,) = post.emit_text(pending)
    assert done.handle is text and done.last.finish_reason == "stop" and done.last.text == ""
    assert ignore_eos.queue.get_nowait().text == "a" and text.queue.empty()


def test_p_first_token_on_d_goes_through_the_same_checks():
    post = OutputProcessor(Tok(), max_model_len=64, metrics=None)
    one = handle("one", GenerationOptions(max_tokens=1))
    done = post.accept(one, 4, [], 0.0)
    assert done is not None and done.last.finish_reason == "length" and done.last.text == "e"
    more = handle("more", GenerationOptions(max_tokens=5, stop_token_ids=(4,)))
    assert post.accept(more, 5, [], 0.0) is None and more.queue.get_nowait().text == "f"
    done = post.accept(more, 4, [], 0.0)
    assert done is not None and done.last.finish_reason == "stop"
    assert more.seq.output_ids == [5, 4]
