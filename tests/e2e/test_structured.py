"""Structured outputs on the real model through every route: router + P + D (decode-local off),
decode-local on D, and one co-located worker. Samples at temperature 1.0 parse and validate;
regex and choice match exactly; P's first token is constrained; the openai SDK's `parse()` works;
bad constraints are 400s. Every page is free after each scenario."""

from __future__ import annotations

import asyncio
import json
import os
import re

import aiohttp
import jsonschema
import pytest

from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.transfer import nixl_available
from tests.e2e.conftest import assert_all_pages_free, make_worker, wait_idle
from tests.e2e.processes import wait_pages_free
from tests.e2e.test_pd import start_router

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="the KV pull needs a NIXL package"),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "floor": {"type": "integer", "minimum": -2, "maximum": 99},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "nickname": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "age", "pet", "home"],
    "additionalProperties": False,  # what OpenAI's strict mode asks of a schema
}
PERSON = "Describe a made-up person as JSON with name, age, pet, friends and home."
SEEDS = range(int(os.environ.get("PD_STRUCTURED_SEEDS", "5")))  # 20 in the reported run


@pytest.fixture(scope="module")
def pair(fp32_pair):
    return fp32_pair  # the session's fp32 P and D (tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def colocated():
    return make_worker()


@pytest.fixture(params=["pd", "local", "both"])
async def route(request, pair, colocated, aiohttp_server):
    """(base URL, http session) of one route; every page free afterwards."""
    p_url, d_url = pair
    async with aiohttp.ClientSession() as http:
        if request.param == "both":
            from pd.worker.api.server import make_app

            server = await aiohttp_server(make_app(colocated))
            yield str(server.make_url("")).rstrip("/"), http
            await wait_idle(colocated)
            assert_all_pages_free(colocated)
            return
        if request.param == "pd":
            url = await start_router(aiohttp_server, p_url, d_url)
        else:  # every request decode-local: D prefills it itself
            cfg = RouterConfig(
                port=0, prefill=(p_url,), decode=(d_url,), health_interval=0.2,
                local_prefill_max_tokens=100_000,
            )  # fmt: skip
            server = await aiohttp_server(make_router(cfg))
            url = str(server.make_url("")).rstrip("/")
            await wait_pages_free(http, d_url)
        yield url, http
        for worker_url in pair:
            await wait_pages_free(http, worker_url)


async def chat(http, url: str, content: str, **body) -> dict:
    resp = await http.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": content}], **body},
    )
    answer = await resp.json()
    assert resp.status == 200, answer
    return answer


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


async def test_json_schema_samples_parse_and_validate(route):
    """Every seed's sample at once: each constrained among the others (a seeded draw is the
    same whatever shares its batch)."""
    url, http = route

    async def one(seed: int) -> None:
        answer = await chat(
            http, url, PERSON, temperature=1.0, seed=seed, max_tokens=160,
            response_format=schema_format(SCHEMA),
        )  # fmt: skip
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)

    await asyncio.gather(*(one(seed) for seed in SEEDS))


async def test_regex_and_choice_match_exactly(route):
    url, http = route

    async def one(seed: int) -> None:
        answer = await chat(
            http, url, "Give me a phone number.", temperature=1.0, seed=seed, max_tokens=20,
            structured_outputs={"regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"},
        )  # fmt: skip
        phone = answer["choices"][0]["message"]["content"]
        assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", phone), phone
        answer = await chat(
            http, url, "Which is the capital of France?", temperature=1.0, seed=seed,
            max_tokens=10, guided_choice=["Paris", "London", "Berlin"],
        )  # fmt: skip
        assert answer["choices"][0]["message"]["content"] in ("Paris", "London", "Berlin")

    await asyncio.gather(*(one(seed) for seed in SEEDS))


async def test_the_first_token_is_constrained_where_it_is_sampled(route):
    # P samples the first token in PD: an answer that starts with prose unconstrained starts
    # with "{" constrained, also when P alone answers (max_tokens 1).
    url, http = route
    prose = await chat(http, url, "Tell me about cats.", temperature=0, max_tokens=4)
    assert not prose["choices"][0]["message"]["content"].lstrip().startswith("{")
    for max_tokens in (1, 8):
        answer = await chat(
            http, url, "Tell me about cats.", temperature=0, max_tokens=max_tokens,
            response_format={"type": "json_object"},
        )  # fmt: skip
        assert answer["choices"][0]["message"]["content"].startswith("{"), answer


async def test_bad_constraints_are_400s_naming_the_problem(route):
    url, http = route
    for body, needle in [
        ({"response_format": schema_format({"type": "nope"})}, "Invalid type"),
        ({"structured_outputs": {"regex": "[a-z"}}, "regex"),
        ({"guided_grammar": "start: ???"}, "Expected"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "one structured-output"),
    ]:
        resp = await http.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
        )
        error = (await resp.json())["error"]
        assert resp.status == 400 and needle in error["message"], error


async def test_the_openai_sdk_parse_returns_a_parsed_object(pair, aiohttp_server):
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        population_millions: int = pydantic.Field(ge=0, le=100)

    url = await start_router(aiohttp_server, *pair)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
    completion = await client.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name, completion
    await client.close()
    async with aiohttp.ClientSession() as http:
        for worker_url in pair:
            await wait_pages_free(http, worker_url)


async def test_a_grammar_that_does_not_compile_in_time_is_a_400(aiohttp_client):
    from pd.worker.api.server import make_app

    worker = make_worker(grammar_timeout_s=1.0)
    client = await aiohttp_client(make_app(worker))
    options = [f"option number {i}" for i in range(60_000)]  # ~8 s to compile
    resp = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
              "structured_outputs": {"choice": options}},
    )  # fmt: skip
    error = (await resp.json())["error"]
    assert resp.status == 400 and "did not compile within" in error["message"], error
    assert error["code"] == "invalid_grammar"
    await wait_idle(worker)
    assert_all_pages_free(worker)
