"""vLLM's /tokenize and /detokenize on a worker (the real default tokenizer, a stand-in engine),
and CORS: the ids are those a completion or a chat request with the same prompt uses."""

from __future__ import annotations

import orjson
import pytest

from pd.config import WorkerConfig
from pd.protocol import MAX_TOKENIZE_CHARS, parse_request
from pd.worker.api.prompt import PromptBuilder
from pd.worker.api.server import make_app
from pd.worker.build import Worker
from pd.worker.checkpoint.default_model import default_model_path
from pd.worker.checkpoint.gguf_file import read_gguf_metadata
from pd.worker.checkpoint.gguf_tokenizer import tokenizer_from_gguf_metadata
from pd.worker.disagg import CoLocated
from pd.worker.metrics import WorkerMetrics
from pd.worker.text import Tokenizer

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tokenizer_from_gguf_metadata(read_gguf_metadata(default_model_path()))


class StandInEngine:
    max_model_len = MAX_MODEL_LEN

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def worker(tok: Tokenizer, **config) -> Worker:
    return Worker(
        WorkerConfig(served_model_name="stub", **config), tok, engine := StandInEngine(),
        WorkerMetrics(), "stub", role=CoLocated(engine), accepted_names=frozenset({"stub"}),
    )  # type: ignore[arg-type]  # fmt: skip


async def post(client, path: str, body: dict, **headers):
    headers = {"Content-Type": "application/json", **headers}
    resp = await client.post(path, data=orjson.dumps(body), headers=headers)
    return resp, orjson.loads(await resp.read())


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


async def test_tokenize_gives_the_ids_the_endpoints_use(aiohttp_client, tok):
    client = await aiohttp_client(make_app(worker(tok)))
    prompts = PromptBuilder(tok, MAX_MODEL_LEN)
    text = "The quick brown fox jumps over the lazy dog."
    resp, body = await post(client, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert resp.status == 200, body
    expected = await prompts.prompt_ids(parse_request("/v1/completions", {"prompt": text}))
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == [tok.id_to_token(t) for t in expected]
    assert body["token_strs"][1] == "Ġquick"

    resp, body = await post(client, "/tokenize", {"messages": MESSAGES, "model": "stub"})
    assert resp.status == 200, body
    chat = parse_request("/v1/chat/completions", {"messages": MESSAGES})
    assert body["tokens"] == await prompts.prompt_ids(chat) and body["token_strs"] is None
    resp, without = await post(
        client, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}
    )
    assert without["count"] < body["count"]
    assert body["tokens"][: without["count"]] == without["tokens"]

    resp, back = await post(client, "/detokenize", {"tokens": body["tokens"]})
    assert resp.status == 200, back
    assert back == {"prompt": tok.decode(body["tokens"], skip_special_tokens=False)}
    assert back["prompt"].startswith("<|im_start|>system\nBe brief.")
    prompts.close()


async def test_tokenize_renders_tools_as_a_chat_request_does(aiohttp_client, tok):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    client = await aiohttp_client(make_app(worker(tok)))
    resp, body = await post(client, "/tokenize", {"messages": MESSAGES, "tools": tools})
    assert resp.status == 200, body
    prompts = PromptBuilder(tok, MAX_MODEL_LEN)
    chat = parse_request("/v1/chat/completions", {"messages": MESSAGES, "tools": tools})
    assert body["tokens"] == await prompts.prompt_ids(chat)
    assert "get_time" in tok.decode(body["tokens"], skip_special_tokens=False)
    resp, body = await post(client, "/tokenize", {"messages": MESSAGES, "tools": [{"x": 1}]})
    assert resp.status == 400 and body["error"]["param"] == "tools", body
    prompts.close()


async def test_a_prompt_longer_than_the_context_is_counted(aiohttp_client, tok):
    client = await aiohttp_client(make_app(worker(tok)))
    resp, body = await post(client, "/tokenize", {"prompt": "hello" + " hello" * 2999})
    assert resp.status == 200 and body["count"] == 3000 > body["max_model_len"]
    # Up to MAX_TOKENIZE_CHARS (past any prompt: the loop waits on tokenizers ~30 ms a MiB).
    resp, body = await post(client, "/tokenize", {"prompt": "a" * (MAX_TOKENIZE_CHARS + 1)})
    assert resp.status == 400 and body["error"]["code"] == "prompt_too_large"


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        ("/tokenize", {}, 400, "invalid_value"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "invalid_value"),
        ("/tokenize", {"prompt": 5}, 400, "invalid_type"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "invalid_type"),
        ("/tokenize", {"prompt": "a", "model": "gpt-9"}, 404, "model_not_found"),
        ("/tokenize", {"prompt": "a", "truncate": 3}, 400, "unknown_parameter"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ x }}"}, 400,
         "unsupported_parameter"),
        ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, 400, "invalid_value"),
        ("/detokenize", {"tokens": [1, -2]}, 400, "invalid_value"),
        ("/detokenize", {"tokens": [10**9]}, 400, "invalid_value"),
        ("/detokenize", {"tokens": "1 2"}, 400, "invalid_value"),
        ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "unknown_parameter"),
    ],
)  # fmt: skip
async def test_bad_bodies_are_openai_errors(aiohttp_client, tok, path, body, status, code):
    client = await aiohttp_client(make_app(worker(tok)))
    resp, answer = await post(client, path, body)
    assert resp.status == status, answer
    assert set(answer) == {"error"} and answer["error"]["code"] == code, answer


async def test_the_api_key_guards_tokenize(aiohttp_client, tok):
    client = await aiohttp_client(make_app(worker(tok, api_key="k")))
    resp, body = await post(client, "/tokenize", {"prompt": "a"})
    assert resp.status == 401 and body["error"]["code"] == "invalid_api_key"
    resp, body = await post(client, "/tokenize", {"prompt": "a"}, Authorization="Bearer k")
    assert resp.status == 200 and body["count"] == 1


PREFLIGHT = {
    "Origin": "http://ui.example:3000",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


async def test_cors_preflight_and_answers_for_an_allowed_origin(aiohttp_client, tok):
    w = worker(tok, api_key="k", allowed_origins=("http://ui.example:3000",))
    client = await aiohttp_client(make_app(w))
    resp = await client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert resp.status == 200
    assert resp.headers["Access-Control-Allow-Origin"] == "http://ui.example:3000"
    assert "AUTHORIZATION" in resp.headers["Access-Control-Allow-Headers"].upper()
    # An answer (an error one too) carries the header the browser needs to read it.
    resp, body = await post(client, "/tokenize", {"prompt": "a"}, Origin=PREFLIGHT["Origin"])
    assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == PREFLIGHT["Origin"]
    # Another origin is not allowed: its preflight is refused, its answers carry no header.
    resp = await client.options("/tokenize", headers={**PREFLIGHT, "Origin": "http://evil.example"})
    assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers


async def test_no_cors_by_default(aiohttp_client, tok):
    client = await aiohttp_client(make_app(worker(tok)))
    resp = await client.options("/v1/completions", headers=PREFLIGHT)
    assert resp.status == 405 and "Access-Control-Allow-Origin" not in resp.headers


@pytest.mark.parametrize("origin", ["http://a.example/", "a.example", "http://a.example/ui"])
def test_an_origin_that_never_matches_is_a_config_error(origin):
    with pytest.raises(ValueError, match="no origin"):
        WorkerConfig(allowed_origins=(origin,))
