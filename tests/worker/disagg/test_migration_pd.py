"""Migration through a real prefill side and decode side in one process (the `fake` transfer
backend, a stand-in model: test_lifecycle.py): a continuation's output ids ride P's params to D,
and a drain migrates decode requests still pulling or waiting for pages, every page back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pd.protocol import APIError, GenerationOptions
from pd.worker.build import Worker
from pd.worker.engine import RequestHandle
from tests.admit import add_remote
from tests.worker.disagg.test_lifecycle import PROMPT, drain, until
from tests.worker.disagg.test_lifecycle import make_pair as make_pair  # a fixture


async def test_a_continuation_rides_ps_params_to_d(make_pair):
    pair = await make_pair()
    given = [9, 8]
    h = add_remote(pair.p, pair.prefill, PROMPT, GenerationOptions(max_tokens=1), given=given)
    delta = await asyncio.wait_for(h.queue.get(), 5)
    assert delta.error is None and delta.token_ids == [7], delta
    kvp = h.kv_transfer_params
    assert kvp is not None and kvp["output_token_ids"] == given
    assert kvp["prompt_token_ids"] == PROMPT and kvp["num_tokens"] == len(PROMPT) + 2
    assert kvp["first_token_id"] == 7
    pair.p.abort(h)
    for wrong in (None, [9], [9, 8, 1]):
        with pytest.raises(APIError) as e:
            pair.decode.validate(kvp, 1, wrong)
        assert e.value.status == 400 and e.value.param == "pd_continuation"
    checked = pair.decode.validate(kvp, 1, given)
    d = await pair.decode.admit(checked, GenerationOptions(max_tokens=6))
    assert d.seq.output_ids[:3] == [9, 8, 7] and d.seq.num_given == 2
    tokens, error = await drain(d)
    assert error is None and tokens == [7, 7, 7, 7]  # P's first, then D's: 6 - 2 given
    pair.d.abort(d)
    await until(lambda: pair.prefill.released.get("done") == 1, 2, "P told done")
    await pair.assert_settled()


async def test_a_drain_migrates_decode_requests_pulling_and_waiting_for_pages(make_pair):
    pair = await make_pair(d_pages=8)
    pair.d_backend.read_delay_s = 30  # the first pull holds D's pages
    pulling = await pair.decode_request()
    waiting = await pair.decode_request()
    await until(lambda: pair.d.load().waiting_for_pages == 1, 2, "the second pull queued")
    worker = SimpleNamespace(engine=pair.d, migratable={(pulling,), (waiting,)})
    assert Worker.migrate_streams(worker) == 2  # type: ignore[arg-type]
    for h in (pulling, waiting):
        assert await events(h) == [[7], "migrate"]  # P's first token, then the end
        assert h.finished
    await until(lambda: pair.prefill.released.get("abort") == 2, 2, "P told abort twice")
    await pair.assert_settled()


async def events(h: RequestHandle) -> list:
    out: list = []
    while True:
        delta = await asyncio.wait_for(h.queue.get(), 5)
        assert delta.error is None and delta.finish_reason is None, delta
        if delta.migrate:
            return [*out, "migrate"]
        out.append(delta.token_ids)
