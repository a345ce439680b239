"""Migration at the edge, no model (docs/migration.md): the `: pd-ids` lines of
`ResponseBuilder` events, `pd_continuation` parsing and its 400s, P's `output_token_ids` in
`kv_transfer_params`, and an engine priming a continuation (page accounting intact)."""

from __future__ import annotations

import asyncio
import re

import pytest

from pd.protocol import APIError, KVTransferParams, parse_continuation, parse_request
from pd.protocol.names import SSE_MIGRATE
from pd.worker.api.openai_format import ResponseBuilder
from pd.worker.engine import Delta
from pd.worker.tools.segments import segmenter
from pd.worker.tools.stream import ToolStream
from tests.admit import admit

IDS_LINE = re.compile(rb": pd-ids (\d+)((?: \d+)+)\n")


def builder(**kw) -> ResponseBuilder:
    return ResponseBuilder(chat=kw.pop("chat", True), model="m", prompt_tokens=3,
                           token_text=str, **kw)  # fmt: skip


def emitted(b: ResponseBuilder, delta: Delta) -> bytes:
    b.add(delta)
    return b.chunk(delta)


def events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


@pytest.mark.parametrize("chat", [True, False])
def test_an_event_with_tokens_opens_with_its_ids_line(chat):
    b = builder(chat=chat, announce_ids=True, index=3)
    assert b": pd-" not in b.chunk(None, role=True)  # the role chunk: no token
    raw = emitted(b, Delta("ab", [17, 4, 250], []))
    (event,) = events(raw)
    ids, data = event.split(b"\n")
    assert IDS_LINE.fullmatch(ids + b"\n") and ids == b": pd-ids 3 17 4 250"
    assert data.startswith(b"data: {") and b'"index":3' in data
    # A held-back delta still carries its token; a last delta without one carries no line.
    assert emitted(b, Delta("", [9], [])).startswith(b": pd-ids 3 9\ndata: ")
    assert emitted(b, Delta("", [], [], "length")).startswith(b"data: ")
    assert b": pd-" not in b.usage_chunk()


def test_no_line_without_the_header():
    b = builder()
    for delta in (Delta("ab", [1, 2], []), Delta("", [3], [], "stop")):
        assert b": pd-" not in emitted(b, delta)


def test_n_choices_interleaved_each_name_their_index():
    bs = [builder(announce_ids=True, index=i) for i in range(3)]
    raw = b"".join(emitted(bs[i], Delta(f"t{i}{j}", [10 * i + j], [])) for j in range(2)
                   for i in (2, 0, 1))  # fmt: skip
    lines = IDS_LINE.findall(raw)
    assert [(int(i), ids.split()) for i, ids in lines] == [
        (i, [str(10 * i + j).encode()]) for j in range(2) for i in (2, 0, 1)
    ]
    for event in events(raw):
        ids, data = event.split(b"\n")
        assert b'"index":' + ids.split()[2] in data


def test_tool_chunks_carry_the_ids_once_and_an_event_while_held_back():
    def tool_builder(announce: bool) -> ResponseBuilder:
        return builder(announce_ids=announce, tools=ToolStream(segmenter("hermes")))

    b = tool_builder(True)
    # "<tool_call>" is held back while it may be a call's opening: still an event, with its ids
    held = emitted(b, Delta("<tool_", [5, 6], []))
    (event,) = events(held)
    assert event.startswith(b": pd-ids 0 5 6\ndata: ") and b'"delta":{}' in event
    assert b": pd-" not in emitted(tool_builder(False), Delta("<tool_", [5, 6], []))
    raw = emitted(b, Delta('call>{"name": "f", "arguments": {"x": 1}}</tool_call>', [7], []))
    assert raw.count(b": pd-ids") == 1 and raw.startswith(b": pd-ids 0 7\ndata: ")
    assert len(events(raw)) >= 2  # the call's id/name piece, then its arguments


def test_the_migrate_event_is_a_comment():
    assert SSE_MIGRATE == b": pd-migrate draining\n\n"


# ---------------------------------------------------------------------------- the request


def refused(value, n: int = 1) -> dict:
    with pytest.raises(APIError) as e:
        parse_continuation(value, n)
    err = e.value
    assert err.status == 400 and err.param == "pd_continuation" and err.code == "invalid_value"
    return err.body()


def test_continuation_parse():
    assert parse_continuation(None) is None
    assert parse_continuation({"output_token_ids": []}) == []
    assert parse_continuation({"output_token_ids": [0, 5, 49151]}) == [0, 5, 49151]
    body = {"prompt": "hi", "pd_continuation": {"output_token_ids": [3, 4]}}
    assert parse_request("/v1/completions", body).continuation == [3, 4]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_request("/v1/chat/completions", chat).continuation is None


@pytest.mark.parametrize(
    "value",
    [[1, 2], "x", 3, {}, {"output_token_ids": [1], "extra": 0}, {"output_token_ids": None},
     {"output_token_ids": [1.5]}, {"output_token_ids": [True]}, {"output_token_ids": [-1]},
     {"output_token_ids": [1 << 40]}, {"output_token_ids": "1 2"}],
)  # fmt: skip
def test_malformed_continuations_are_400s(value):
    body = refused(value)
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


def test_a_continuation_continues_one_choice():
    refused({"output_token_ids": [1]}, n=2)
    with pytest.raises(APIError) as e:
        parse_request(
            "/v1/completions", {"prompt": "hi", "n": 3, "pd_continuation": {"output_token_ids": []}}
        )
    assert e.value.param == "pd_continuation"


KV = dict(
    remote_engine_id="e", remote_host="h", remote_port=1, transfer_id="t",
    prompt_token_ids=[1, 2], first_token_id=3, page_ids={"kv": [0]}, num_tokens=4,
    page_size=16, tp_size=1, kv_layout="HND", dtype="float32", model_fingerprint="m",
    lease_ttl_s=5.0, pd_version=1,
)  # fmt: skip


def test_kv_params_carry_the_continuations_output_ids():
    kvp = KVTransferParams.from_dict({**KV, "output_token_ids": [7, 8]})
    assert kvp.output_token_ids == [7, 8]
    assert KVTransferParams.from_dict(KV).output_token_ids is None
    assert KVTransferParams.from_dict(kvp.to_dict()) == kvp
    for bad in ([-1], [1.0], "78", [True], {"a": 1}):
        with pytest.raises(APIError) as e:
            KVTransferParams.from_dict({**KV, "output_token_ids": bad})
        assert e.value.status == 400 and "output_token_ids" in e.value.message


# ----------------------------------------------------------------------------- the engine


class Tok:
    """Token t's text is chr(ord('a') + t % 26); 0 is EOS."""

    eos_token_ids = [0]
    vocab_size = 64

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids if t or not skip_special_tokens)


async def test_the_engine_primes_a_continuation_and_prefills_prompt_and_outputs():
    from pd.kvcache.cache_manager import KVCacheManager
    from pd.protocol import GenerationOptions
    from pd.worker.engine import Engine, Scheduler
    from pd.worker.model.sampler import SampleOutput

    seen: list[tuple[int, int]] = []  # per sampled row: (tokens computed, output position)

    class Runner:
        def execute(self, batch):
            for s in batch.sampled:
                seen.append((s.num_computed, len(s.output_ids)))
            return SampleOutput(token_ids=[5] * len(batch.sampled))

    cache = KVCacheManager(num_pages=32, page_size=4)
    scheduler = Scheduler(cache, chunk_size=64, max_running=4)
    engine = Engine(Runner(), scheduler, Tok(), max_model_len=64, max_waiting=8)
    engine.start()
    try:
        opts = GenerationOptions(max_tokens=6, temperature=0.0, stop=("cd",))
        h = engine.add(admit([1, 2, 3], opts, given=[1, 2]))  # text "bc": "c" held back
        assert h.seq.output_ids == [1, 2] and h.seq.num_given == 2 and h.given_text == "b"
        deltas = []
        while not deltas or deltas[-1].finish_reason is None:
            deltas.append(await asyncio.wait_for(h.queue.get(), 5))
        assert [t for d in deltas for t in d.token_ids] == [5] * 4  # 6 - 2 given
        assert "".join(d.text for d in deltas) == "c" + "f" * 4
        assert seen[0] == (0, 2)  # one prefill of prompt + given; sampled at output position 2
        # A stop string the first new token completes ("c" held, then "d").
        h = engine.add(admit([1, 2, 3], GenerationOptions(max_tokens=6, stop=("cf",)), given=[2]))
        d = await asyncio.wait_for(h.queue.get(), 5)
        assert d.finish_reason == "stop" and d.text == "" and d.token_ids == [5]
        # The budget spent, or EOS given: it ends at once, nothing sampled, no page taken.
        for given, reason in (([1] * 6, "length"), ([1, 0], "stop")):
            h = engine.add(admit([1, 2, 3], opts, given=given))
            d = await asyncio.wait_for(h.queue.get(), 5)
            assert (d.finish_reason, d.token_ids, d.text) == (reason, [], "")
            assert h.finished and not engine.handles
        # More ids than the context allows: a 400.
        with pytest.raises(APIError) as e:
            engine.add(admit([1, 2, 3], GenerationOptions(max_tokens=None), given=[1] * 61))
        assert e.value.param == "pd_continuation"
        for _ in range(500):  # a step that ran beside the stop ends before its pages go
            if not scheduler.has_work:
                break
            await asyncio.sleep(0.01)
        scheduler.check_integrity()
        assert cache.num_free == cache.num_total
    finally:
        await engine.stop()
