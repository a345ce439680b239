"""echo, text_offset, prompt_logprobs and max_tokens 0 as answers render them (no model): the
prompt's part first (its first token's logprob null), offsets into the choice's text, vLLM's
prompt_logprobs shape, and the 400s for values pd does not serve."""

from __future__ import annotations

import orjson
import pytest

from pd.protocol import APIError, KVTransferParams, parse_request
from pd.worker.api.echo import prompt_part
from pd.worker.api.openai_format import ResponseBuilder
from pd.worker.api.server import make_app
from pd.worker.engine import Delta

JSON_HEADERS = {"Content-Type": "application/json"}


class Tok:
    """Token i is the letter chr(a + i % 26); token 30 is a two-letter one."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join("xy" if i == 30 else chr(ord("a") + i % 26) for i in ids)


def text(t: int) -> str:
    return Tok().decode([t])


PROMPT = [1, 30, 2, 3]
# Entry p is for prompt token p + 1: (its logprob, its rank, the top alternatives).
COMPUTED = [(-1.5, 2, [(7, -0.5), (30, -1.5)]), (-0.25, 1, [(2, -0.25), (9, -2.0)]),
            (-3.0, 3, [(4, -1.0), (5, -2.0)])]  # fmt: skip


def part(echo=True, echo_logprobs=1, prompt_logprobs=None):
    return prompt_part(
        PROMPT, COMPUTED, Tok(), text,
        echo=echo, echo_logprobs=echo_logprobs, prompt_logprobs=prompt_logprobs,
    )  # fmt: skip


def builder(**kw) -> ResponseBuilder:
    return ResponseBuilder(
        chat=False, model="m", prompt_tokens=len(PROMPT), token_text=text, wants_logprobs=True,
        **kw,
    )  # fmt: skip


def test_echo_with_logprobs_puts_the_prompt_first_and_its_first_token_has_null():
    b = builder(prompt_part=lambda: part(echo_logprobs=1))
    b.add(Delta("h", [7], [(7, -0.75, [(7, -0.75)])]))
    b.add(Delta("ij", [8], [(8, -0.5, [(8, -0.5)])], "length"))
    choice = b.final()["choices"][0]
    assert choice["text"] == "bxycd" + "hij"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["b", "xy", "c", "d", "h", "i"]
    assert lp["token_logprobs"] == [None, -1.5, -0.25, -3.0, -0.75, -0.5]
    assert lp["top_logprobs"] == [None, {"h": -0.5}, {"c": -0.25}, {"e": -1.0},
                                  {"h": -0.75}, {"i": -0.5}]  # fmt: skip
    assert lp["text_offset"] == [0, 1, 3, 4, 5, 6]  # into the choice's text, generated too
    assert "prompt_logprobs" not in choice


def test_prompt_logprobs_have_vllms_shape_the_token_first_then_the_top_k():
    b = builder(prompt_part=lambda: part(echo=False, prompt_logprobs=1))
    b.add(Delta("h", [7], [(7, -0.75, [])], "length"))
    choice = b.final()["choices"][0]
    assert choice["text"] == "h" and choice["logprobs"]["text_offset"] == [0]
    assert choice["prompt_logprobs"] == [
        None,
        {"30": {"logprob": -1.5, "rank": 2, "decoded_token": "xy"},
         "7": {"logprob": -0.5, "rank": 1, "decoded_token": "h"}},
        {"2": {"logprob": -0.25, "rank": 1, "decoded_token": "c"}},  # the token is the top one
        {"3": {"logprob": -3.0, "rank": 3, "decoded_token": "d"},
         "4": {"logprob": -1.0, "rank": 1, "decoded_token": "e"}},
    ]  # fmt: skip
    chat = ResponseBuilder(chat=True, model="m", prompt_tokens=4, token_text=text,
                           prompt_part=lambda: part(echo=False, prompt_logprobs=0))  # fmt: skip
    chat.add(Delta("h", [7], [], "stop"))
    body = chat.final()
    assert body["prompt_logprobs"][1] == {"30": {"logprob": -1.5, "rank": 2, "decoded_token": "xy"}}
    assert "prompt_logprobs" not in body["choices"][0]  # chat: at the top level, as vLLM


def test_max_tokens_0_answers_the_prompt_alone():
    b = builder(prompt_part=lambda: part(echo_logprobs=0))
    b.add(Delta("", [], [], "length"))
    body = b.final()
    choice = body["choices"][0]
    assert choice["text"] == "bxycd" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5, -0.25, -3.0]
    assert choice["logprobs"]["top_logprobs"] == [None, {}, {}, {}]
    assert body["usage"]["completion_tokens"] == 0


def test_a_stream_carries_the_prompt_in_its_first_chunk_only():
    b = builder(prompt_part=lambda: part(echo_logprobs=1, prompt_logprobs=0))
    chunks = []
    for delta in (Delta("h", [7], [(7, -0.75, [])]), Delta("i", [8], [(8, -0.5, [])], "length")):
        b.add(delta)
        chunks.append(orjson.loads(b.chunk(delta)[len(b"data: ") :])["choices"][0])
    assert chunks[0]["text"] == "bxycdh" and chunks[1]["text"] == "i"
    assert chunks[0]["logprobs"]["text_offset"] == [0, 1, 3, 4, 5]
    assert chunks[1]["logprobs"]["text_offset"] == [6]
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert len(chunks[0]["prompt_logprobs"]) == 4 and "prompt_logprobs" not in chunks[1]


def test_echo_without_logprobs_is_the_text_alone_and_plain_answers_get_text_offset():
    b = builder(prompt_part=lambda: part(echo_logprobs=None))
    b.wants_logprobs = False
    b.add(Delta("h", [7], [], "length"))
    assert b.final()["choices"][0] == {
        "index": 0, "text": "bxycdh", "logprobs": None, "finish_reason": "length"
    }  # fmt: skip
    plain = builder()
    plain.add(Delta("ab", [0], [(0, -1.0, [])]))
    plain.add(Delta("c", [2], [(2, -1.0, [])], "stop"))
    assert plain.final()["choices"][0]["logprobs"]["text_offset"] == [0, 2]


def test_parsing_echo_prompt_logprobs_and_max_tokens_0():
    req = parse_request("/v1/completions", {"prompt": [1, 2], "echo": True, "logprobs": 3,
                                            "max_tokens": 0, "prompt_logprobs": 1})  # fmt: skip
    assert req.echo and req.prompt_logprobs == 1 and req.options.max_tokens == 0
    assert req.options.prompt_logprobs == 3  # what is computed: the larger of the two
    req = parse_request("/v1/completions", {"prompt": "hi", "echo": True})
    assert req.options.prompt_logprobs is None  # echo alone computes nothing
    chat = parse_request("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0,
                          "echo": False})  # fmt: skip
    assert chat.prompt_logprobs == 0 and chat.options.prompt_logprobs == 0


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # without echo
        ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True},
         "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 0}, "max_tokens"),
    ],
)  # fmt: skip
def test_bad_values_are_openai_400s(path, body, param):
    with pytest.raises(APIError) as e:
        parse_request(path, body)
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "code", "param"}


PARAMS = dict(
    remote_engine_id="e", remote_host="h", remote_port=1, transfer_id="t",
    prompt_token_ids=[1, 2, 3], first_token_id=4, page_ids={"kv": [0]}, num_tokens=3,
    page_size=16, tp_size=1, kv_layout="l", dtype="float32", model_fingerprint="f",
    lease_ttl_s=5.0, pd_version=1,
)  # fmt: skip


@pytest.mark.parametrize(
    "value, ok",
    [
        (None, True),
        ([[-1.0, 1, []], [-2.5, 3, [[5, -0.5], [6, -1.0]]]], True),
        ([[-1.0, 0, []]], False),  # ranks start at 1
        ([[-1.0, 1]], False),
        ([[float("nan"), 1, []]], False),
        ([[-1.0, 1, [[5]]]], False),
        ([[-1.0, 1, [[-5, -1.0]]]], False),
        ("[]", False),
    ],
)
def test_kv_transfer_params_check_the_prompt_logprobs_field(value, ok):
    raw = {**PARAMS, "prompt_logprobs": value}
    if ok:
        assert KVTransferParams.from_dict(raw).prompt_logprobs == value
    else:
        with pytest.raises(APIError, match="prompt_logprobs"):
            KVTransferParams.from_dict(raw)


@pytest.mark.parametrize(
    "raw, code",
    [
        (b'{"prompt": "hi", "prompt_logprobs": 21}', "invalid_value"),
        (b'{"prompt": "hi", "max_tokens": 0}', "invalid_value"),
        (b'{"prompt": "hi", "echo": 1}', "invalid_type"),
    ],
)
async def test_the_handler_answers_them_as_openai_errors_and_queues_nothing(
    aiohttp_client, raw, code
):
    from tests.worker.api.test_handler import StandInRole, assert_error, post, worker

    role = StandInRole()
    client = await aiohttp_client(make_app(worker(role)))
    resp, body = await post(client, raw)
    assert_error(resp, body, 400, code)
    chat = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "echo": True}
    )
    assert_error(chat, orjson.loads(await chat.read()), 400, "unsupported_value")
    assert not role.prompts


@pytest.mark.parametrize("large", [False, True])
async def test_echo_through_the_handler_on_a_stand_in_engine(aiohttp_client, monkeypatch, large):
    from pd.worker.api import server
    from tests.worker.api.test_handler import StandInRole, worker

    if large:  # rendered on the text thread
        monkeypatch.setattr(server, "LARGE_PROMPT_PART", 1)
    client = await aiohttp_client(make_app(worker(StandInRole())))
    for stream in (b"false", b"true"):
        raw = b'{"prompt": [1, 2, 3], "echo": true, "stream": %s}' % stream
        resp = await client.post("/v1/completions", data=raw, headers=JSON_HEADERS)
        assert resp.status == 200
        text = await resp.text()
        if stream == b"false":
            assert orjson.loads(text)["choices"][0]["text"] == "bcd" + "hi"
        else:
            assert '"text":"bcdhi"' in text


def test_a_streaming_builder_keeps_nothing_for_a_final_answer():
    """A stream's chunks carry each delta's text, logprobs and offsets; the builder keeps no
    text or logprobs for an answer never built (a long stream with top_logprobs piled up)."""
    streamed, whole = builder(streaming=True), builder()
    chunks = []
    for _ in range(200):
        d = Delta("ab", [7], [(7, -0.5, [(7, -0.5), (8, -1.0)])])
        streamed.add(d)
        whole.add(d)
        chunks.append(streamed.chunk(d))
    assert streamed.text == [] and streamed.logprobs == [] and len(streamed.offsets) == 1
    assert streamed.chars == whole.chars == 400 and streamed.completion_tokens == 200
    last = orjson.loads(chunks[-1][len(b"data: ") :])["choices"][0]
    assert last["logprobs"]["text_offset"] == [398]  # where the last token starts
