"""`n` and lists of prompts at the edge (pd/protocol/requests.py)."""

from __future__ import annotations

import pytest

from pd.protocol import MAX_N, MAX_PROMPTS, APIError, KVTransferParams, parse_request


def parse(path="/v1/completions", **body):
    base = {"prompt": "hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    return parse_request(path, {**base, **body})


def refused(param: str, **body) -> dict:
    with pytest.raises(APIError) as e:
        parse(**body)
    assert e.value.status == 400 and e.value.param == param
    return e.value.body()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_is_served_up_to_the_limit(path):
    assert parse(path).n == 1
    assert parse(path, n=4).n == 4 and parse(path, n=MAX_N).n == MAX_N
    for bad in (0, MAX_N + 1, "2", 1.5, True):
        with pytest.raises(APIError) as e:
            parse(path, n=bad)
        assert e.value.status == 400 and e.value.param == "n"
        body = e.value.body()["error"]
        assert set(body) == {"message", "type", "code", "param"}
    assert parse(path, n=None).n == 1  # null is absent


def test_best_of_stays_one_only():
    refused("best_of", best_of=2)


def test_prompt_lists():
    one = parse(prompt=["a"])
    assert one.prompt == "a" and one.batch is None  # a batch of one: as today
    assert parse(prompt=[[1, 2]]).prompt == [1, 2] and parse(prompt=[[1, 2]]).batch is None
    assert parse(prompt=[1, 2, 3]).prompt == [1, 2, 3]  # token ids, not a list
    texts = parse(prompt=["a", "b", "c"])
    assert texts.batch == ["a", "b", "c"] and texts.prompt == "a"
    ids = parse(prompt=[[1], [2, 3]])
    assert ids.batch == [[1], [2, 3]]
    assert parse(prompt=["a", [5]]).batch == ["a", [5]]  # vLLM takes mixed lists too
    assert len(parse(prompt=["x"] * MAX_PROMPTS).batch) == MAX_PROMPTS


def test_prompts_times_n_is_bounded():
    assert len(parse(prompt=["x"] * 4, n=16).batch) == 4
    body = refused("n", prompt=["x"] * 5, n=16)
    assert "80 choices" in body["error"]["message"]


@pytest.mark.parametrize(
    "prompt",
    [["x"] * (MAX_PROMPTS + 1), ["a", ""], [[1], []], [[1], [-1]], ["a", 3], [[1], [1.5]],
     ["a", None], [], "", {"a": 1}],
)  # fmt: skip
def test_bad_prompt_lists_are_400s(prompt):
    body = refused("prompt", prompt=prompt)
    assert body["error"]["type"] == "invalid_request_error"


def test_kv_params_carry_every_first_token():
    base = dict(
        remote_engine_id="e", remote_host="h", remote_port=1, transfer_id="t",
        prompt_token_ids=[1, 2], first_token_id=3, page_ids={"kv": [0]}, num_tokens=2,
        page_size=16, tp_size=1, kv_layout="HND", dtype="float32", model_fingerprint="m",
        lease_ttl_s=5.0, pd_version=1,
    )  # fmt: skip
    kvp = KVTransferParams.from_dict({**base, "first_token_ids": [3, 4, 5]})
    assert kvp.first_token_ids == [3, 4, 5]
    assert KVTransferParams.from_dict(base).first_token_ids is None
    lps = [[-0.1, [[3, -0.1]]], [-0.2, None]]
    assert KVTransferParams.from_dict({**base, "first_tokens_logprobs": lps}).first_tokens_logprobs
    for bad in ({"first_token_ids": [-1]}, {"first_token_ids": [1] * (MAX_N + 1)},
                {"first_token_ids": []}, {"first_tokens_logprobs": [[1]]}):  # fmt: skip
        with pytest.raises(APIError):
            KVTransferParams.from_dict({**base, **bad})
