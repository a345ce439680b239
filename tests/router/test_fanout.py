"""Lists of prompts through the router (pd/router/fanout.py): one sub-exchange per prompt."""

from __future__ import annotations

import orjson

from pd.router.fanout import merge_answers, sum_usage
from tests.router.conftest import COMPLETION, sse_events, wait_for

PROMPTS = ["alpha", "beta beta", "gamma gamma gamma"]


async def pd_pair(stub, router, **kw):
    p = await stub("prefill")
    d = await stub("decode")
    return p, d, await router(prefill=[p], decode=[d], **kw)


async def test_a_list_of_prompts_is_answered_as_one_choice_list(stub, router):
    p, d, client = await pd_pair(stub, router)
    resp = await client.post("/v1/completions", json={**COMPLETION, "prompt": PROMPTS})
    assert resp.status == 200
    answer = await resp.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["text"] == "xxxx" for c in answer["choices"])
    assert sorted(b["prompt"] for b in p.requests) == sorted(PROMPTS)  # one prompt each
    assert sorted(b["prompt"] for b in d.requests) == sorted(PROMPTS)
    usage = answer["usage"]
    assert usage["completion_tokens"] == 3 * 4
    assert usage["prompt_tokens"] == sum(max(1, len(x) // 4) for x in PROMPTS)


async def test_a_streamed_list_interleaves_reindexed_events_and_one_done(stub, router):
    p, d, client = await pd_pair(stub, router)
    body = {**COMPLETION, "prompt": PROMPTS, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    events = sse_events(await resp.read())
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    chunks = [orjson.loads(e) for e in events[:-1]]
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 * 2 * 4
    assert len({c["id"] for c in chunks}) == 1
    # The stubs answer n choices per prompt: prompt j's choice c is index j * n + c.
    indexes = {c["choices"][0]["index"] for c in content}
    assert indexes == {0, 1, 2, 3, 4, 5}
    text = {i: "".join(c["choices"][0]["text"] for c in content if c["choices"][0]["index"] == i)
            for i in indexes}  # fmt: skip
    assert text == dict.fromkeys(range(6), "xxxx")
    # Each sub-stream asked its usage (summed here).
    assert all(b["stream_options"]["include_usage"] for b in d.requests)


async def test_final_prefill_answers_of_a_list_are_merged(stub, router):
    p, d, client = await pd_pair(stub, router)
    resp = await client.post(
        "/v1/completions", json={**COMPLETION, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 1}
    )
    assert resp.status == 200
    answer = await resp.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert not d.requests  # P's answers are final


async def test_an_error_in_one_sub_stream_ends_the_stream_with_an_error_event(stub, router):
    p, d, client = await pd_pair(stub, router)
    d.error_after = 1
    resp = await client.post(
        "/v1/completions", json={**COMPLETION, "prompt": PROMPTS, "stream": True}
    )
    events = sse_events(await resp.read())
    assert b"[DONE]" not in events
    assert "error" in orjson.loads(events[-1])


async def test_a_failed_decode_is_the_answer_and_every_pin_is_released(stub, router):
    p, d, client = await pd_pair(stub, router, max_retries=0)
    d.fail_status = 500
    resp = await client.post("/v1/completions", json={**COMPLETION, "prompt": PROMPTS})
    assert resp.status == 500 or resp.status >= 502
    assert "error" in await resp.json()
    # The failed one's and those cancelled with it (released in the background).
    await wait_for(lambda: len(p.released) == len(p.requests) == 3)


def test_merge_answers_renumbers_and_sums():
    a = {"id": "a", "choices": [{"index": 1, "text": "b"}, {"index": 0, "text": "a"}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}  # fmt: skip
    b = {"id": "b", "choices": [{"index": 0, "text": "c"}, {"index": 1, "text": "d"}],
         "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                   "prompt_tokens_details": {"cached_tokens": 2}}}  # fmt: skip
    merged = merge_answers([a, b], 2)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a"), (1, "b"), (2, "c"), (3, "d")
    ]  # fmt: skip
    assert merged["id"] == "a"
    assert merged["usage"] == sum_usage([a["usage"], b["usage"]]) == {
        "prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 2},
    }  # fmt: skip
