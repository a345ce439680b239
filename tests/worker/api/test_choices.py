"""A worker's own answers with several choices (`n` > 1, lists of prompts): the real tokenizer,
engine and scheduler, the fuzz test's stand-in model."""

from __future__ import annotations

import orjson
import pytest

from pd.worker.api.server import make_app
from tests.worker.api.test_fuzz import make_worker, settle

pytestmark = pytest.mark.slow  # loads the default model's tokenizer


@pytest.fixture
async def served(aiohttp_client):
    worker = make_worker()
    client = await aiohttp_client(make_app(worker))
    yield client
    await settle(worker)


def events(raw: bytes) -> list[bytes]:
    return [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


@pytest.mark.parametrize("prompt", [["one", "two", "three"], [[260, 261], [262], [263, 264]]])
async def test_prompts_times_n_choices_in_vllm_order(served, prompt):
    body = {"prompt": prompt, "n": 2, "max_tokens": 3, "ignore_eos": True}
    resp = await served.post("/v1/completions", json=body)
    answer = await resp.json()
    assert resp.status == 200, answer
    assert [c["index"] for c in answer["choices"]] == list(range(6))
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    usage = answer["usage"]
    single = {**body, "prompt": prompt[0], "n": 1}
    one = await (await served.post("/v1/completions", json=single)).json()
    assert usage["completion_tokens"] == 6 * 3
    assert usage["prompt_tokens"] >= 3 and usage["total_tokens"] == usage["prompt_tokens"] + 18
    assert one["usage"]["completion_tokens"] == 3


async def test_a_stream_of_n_choices_ends_each_once_then_done(served):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 4,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    resp = await served.post("/v1/chat/completions", json=body)
    raw = events(await resp.read())
    assert raw[-1] == b"[DONE]" and raw.count(b"[DONE]") == 1
    chunks = [orjson.loads(e) for e in raw[:-1]]
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    roles = [c["choices"][0]["index"] for c in content if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1, 2]
    ends = [c["choices"][0]["index"] for c in content if c["choices"][0]["finish_reason"]]
    assert sorted(ends) == [0, 1, 2]
    assert len({c["id"] for c in chunks}) == 1


async def test_bad_lists_and_n_are_openai_errors(served):
    for body in ({"prompt": ["a"] * 65}, {"prompt": ["a", ""]}, {"prompt": "a", "n": 17}):
        resp = await served.post("/v1/completions", json=body)
        error = (await resp.json())["error"]
        assert resp.status == 400 and set(error) == {"message", "type", "code", "param"}
