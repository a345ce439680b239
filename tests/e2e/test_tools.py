"""Tool calling on the real model with the openai SDK, through the router in front of P + D (real
NIXL between them, decode-local off) and in front of one co-located worker: `required` and named
calls validate under their schemas at temperature 1.0 over seeds (`PD_TOOL_SEEDS`, 5 by default),
streamed and not; streamed and whole answers agree; `auto` parses what the model writes, `none`
never answers a call; a history of calls and results renders; `pydantic_function_tool` round
trips through `chat.completions.parse`. Every page is free after each scenario."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import aiohttp
import jsonschema
import pytest

from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.transfer import nixl_available
from tests.e2e.conftest import assert_all_pages_free, make_worker, wait_idle
from tests.e2e.processes import wait_pages_free
from tests.e2e.test_pd import start_router

openai = pytest.importorskip("openai")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="the KV pull needs a NIXL package"),
]

SEEDS = range(int(os.environ.get("PD_TOOL_SEEDS", "5")))  # 20 in the reported run

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 12}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
     "The current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description":
     "The current time in a timezone", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def pair(fp32_pair):
    return fp32_pair


@pytest.fixture(scope="module")
def colocated():
    return make_worker(threads=1)


@pytest.fixture(params=["pd", "both"])
async def client(request, pair, colocated, aiohttp_server):
    """An openai SDK client of the router in front of P + D, or of one co-located worker;
    every page free (and its accounting whole) afterwards."""
    if request.param == "pd":
        url = await start_router(aiohttp_server, *pair)
    else:
        from pd.worker.api.server import make_app

        worker = await aiohttp_server(make_app(colocated))
        cfg = RouterConfig(port=0, worker=(str(worker.make_url("")).rstrip("/"),),
                           health_interval=0.2)  # fmt: skip
        router = await aiohttp_server(make_router(cfg))
        url = str(router.make_url("")).rstrip("/")
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    yield c
    await c.close()
    if request.param == "pd":
        async with aiohttp.ClientSession() as http:
            for worker_url in pair:
                await wait_pages_free(http, worker_url)
    else:
        await wait_idle(colocated)
        assert_all_pages_free(colocated)


async def ask(client, stream: bool, **body: Any) -> tuple[dict[str, Any], str | None]:
    """(the message, the finish reason) of one request; a stream is checked as it comes: each
    call's first delta has its id, type and name with empty arguments, the next ones only
    argument pieces."""
    body = {"model": "default", "messages": ASK, "tools": TOOLS, **body}
    if not stream:
        completion = await client.chat.completions.create(**body)
        choice = completion.choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason
    content, calls, finish = None, {}, None
    async for chunk in await client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            delta = choice.delta
            if delta.content:
                assert not calls, "content after a call"
                content = (content or "") + delta.content
            for c in delta.tool_calls or ():
                if c.index not in calls:
                    assert c.id.startswith("call_") and c.type == "function", c
                    assert c.function.name and c.function.arguments == "", c
                    calls[c.index] = {"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": ""}}  # fmt: skip
                else:
                    assert c.id is None and c.function.name is None, c
                    calls[c.index]["function"]["arguments"] += c.function.arguments
    message: dict[str, Any] = {"role": "assistant"}
    if content is not None:
        message["content"] = content
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


def valid_calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    for call in message["tool_calls"]:
        assert call["id"].startswith("call_") and call["type"] == "function", call
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[name])
        calls.append((name, args))
    return calls


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls", ())]
    return {**message, "tool_calls": calls}


async def test_required_and_named_calls_validate_over_seeds(client):
    """Every seed at once (a seeded draw is the same whatever shares its batch)."""
    await asyncio.gather(*(_required_and_named(client, seed) for seed in SEEDS))


async def _required_and_named(client, seed: int) -> None:
    stream = seed % 2 == 0
    parallel = seed % 4 < 2
    message, finish = await ask(
        client, stream, tool_choice="required", parallel_tool_calls=parallel,
        temperature=1.0, seed=seed, max_tokens=200,
    )  # fmt: skip
    assert finish == "tool_calls", (seed, message)
    calls = valid_calls(message)
    assert calls and (parallel or len(calls) == 1), (seed, message)
    assert message.get("content") is None, message
    message, finish = await ask(
        client, not stream, temperature=1.0, seed=seed, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    assert finish == "tool_calls", (seed, message)
    assert [name for name, _ in valid_calls(message)] == ["get_time"], message


async def test_an_open_schema_admits_only_its_declared_keys_over_20_seeds(client):
    """A tool schema that says nothing of `additionalProperties` admits only its declared keys
    (vLLM's default backend reads it so; llguidance alone would let the model invent keys at
    temperature 0.8), in the declared order. 20 seeds at once: at least 19 schema-valid."""
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]

    async def one(seed: int) -> bool:
        message, finish = await ask(client, False, tools=tools, tool_choice="required",
                                    temperature=0.8, seed=seed, max_tokens=80)  # fmt: skip
        try:
            (call,) = message["tool_calls"]
            args = json.loads(call["function"]["arguments"])
            jsonschema.validate(args, {**weather, "additionalProperties": False})
        except (KeyError, ValueError, jsonschema.ValidationError):
            return False  # (a city longer than max_tokens allows: cut short)
        assert list(args) == ["city", "unit"], args
        return finish == "tool_calls"

    valid = await asyncio.gather(*(one(seed) for seed in range(20)))
    assert sum(valid) >= 19, valid


async def test_streamed_and_whole_answers_agree(client):
    for tool_choice in ("required", "auto"):
        whole = await ask(client, False, tool_choice=tool_choice, temperature=0, max_tokens=40)
        streamed = await ask(client, True, tool_choice=tool_choice, temperature=0, max_tokens=40)
        assert without_ids(streamed[0]) == without_ids(whole[0]) and streamed[1] == whole[1]


async def test_auto_parses_what_the_model_writes_and_none_never_calls(client):
    for seed in SEEDS[:2]:  # (each answer is prose, mostly: max_tokens long)
        message, finish = await ask(
            client, seed % 2 == 0, tool_choice="auto", temperature=1.0, seed=seed, max_tokens=24
        )
        if message.get("tool_calls"):
            assert finish == "tool_calls" or finish == "length", message
            for call in message["tool_calls"]:
                assert call["function"]["name"], call
                json.loads(call["function"]["arguments"])
        else:
            assert finish in ("stop", "length") and isinstance(message.get("content"), str)
        message, finish = await ask(
            client, seed % 2 == 1, tool_choice="none", temperature=1.0, seed=seed, max_tokens=24
        )
        assert "tool_calls" not in message and finish in ("stop", "length"), message


async def test_a_history_of_calls_and_results_renders_and_answers(client):
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]  # fmt: skip
    for stream in (False, True):
        message, finish = await ask(
            client, stream, messages=history, temperature=0, max_tokens=16, tool_choice="none"
        )
        assert message["content"] and finish in ("stop", "length"), message
    message, finish = await ask(client, False, messages=history, tool_choice="required",
                                temperature=0, max_tokens=60)  # fmt: skip
    assert finish == "tool_calls" and valid_calls(message), message


async def test_a_call_cut_short_is_length_and_parses_what_it_can(client):
    for max_tokens in (1, 6):  # 1: P's own answer in PD
        for stream in (False, True):
            message, finish = await ask(
                client, stream, tool_choice="required", temperature=0, max_tokens=max_tokens
            )
            # Constrained from the first token (P's, in PD): the text is the array's, no prose.
            assert finish == "length" and not message.get("content"), message
            for call in message.get("tool_calls", ()):
                json.loads(call["function"]["arguments"])


async def test_pydantic_function_tool_round_trips(client):
    pydantic = pytest.importorskip("pydantic")

    class Booking(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=16)
        nights: int = pydantic.Field(ge=1, le=9)
        breakfast: bool

    tool = openai.pydantic_function_tool(Booking, name="book_hotel")
    assert tool["function"]["strict"] is True
    completion = await client.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "Book me two nights in Rome."}],
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    (call,) = completion.choices[0].message.tool_calls
    assert completion.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "book_hotel" and isinstance(call.function.parsed_arguments, Booking)
    assert Booking.model_validate_json(call.function.arguments) == call.function.parsed_arguments


async def test_n_choices_each_make_a_valid_call_streamed_and_not(client):
    """`n: 3` with a `required` call: every choice parses its own output into calls (each with
    its index in a stream), on P + D as on a co-located worker."""
    body = {"model": "default", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 200}  # fmt: skip
    completion = await client.chat.completions.create(**body)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert valid_calls(choice.message.model_dump(exclude_none=True))
    arguments: dict[int, dict[int, str]] = {}
    finishes: dict[int, str] = {}
    async for chunk in await client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            for c in choice.delta.tool_calls or ():
                calls = arguments.setdefault(choice.index, {})
                calls[c.index] = calls.get(c.index, "") + (c.function.arguments or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    for calls in arguments.values():
        assert calls and all(json.loads(a) is not None for a in calls.values())


async def test_tokenize_through_the_router_counts_the_tools_prompt(client):
    """/tokenize (forwarded to a worker) gives the ids a chat request with the same tools uses:
    its count is the request's prompt_tokens."""
    url = str(client.base_url).removesuffix("/v1/")
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{url}/tokenize", json={"messages": ASK, "tools": TOOLS})
        tokenized = await resp.json()
        assert resp.status == 200, tokenized
        resp = await http.post(f"{url}/detokenize", json={"tokens": tokenized["tokens"]})
        text = (await resp.json())["prompt"]
    assert "get_weather" in text and text.endswith("<|im_start|>assistant\n")
    completion = await client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, max_tokens=1, temperature=0
    )
    assert completion.usage.prompt_tokens == tokenized["count"]
