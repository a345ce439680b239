"""The structured-output requests that crashed workers (a JSON schema whose `$ref`s chain ~3,000
deep, the same schema as a named tool's parameters, a Lark grammar of ~3,000 chained rules)
against a real worker: over the size limits each is a 400 naming the limit; with the limits off
(as if they had missed one) each kills only a grammar child, is a 400 that says so, and the next
request is served. The worker lives on, and its pages are free."""

from __future__ import annotations

import pytest

from pd.worker.api.server import GRAMMARS, make_app
from tests.e2e.conftest import assert_all_pages_free, wait_idle

pytestmark = pytest.mark.slow

LINKS = 3000


def ref_chain(n: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n - 1)}
    defs[f"d{n - 1}"] = {"type": "object", "properties": {"x": {"type": "integer"}}}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(n: int) -> str:
    rules = "\n".join(f"r{i}: r{i + 1}" for i in range(n - 1))
    return f'start: r0\n{rules}\nr{n - 1}: "x"'


def bodies() -> dict[str, dict]:
    """The three crash classes, as chat completion bodies."""
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    schema = ref_chain(LINKS)
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return {
        "response_format": {**base, "response_format": {
            "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}},
        "named tool": {**base, "tools": [tool],
                       "tool_choice": {"type": "function", "function": {"name": "f"}}},
        "lark": {**base, "structured_outputs": {"grammar": rule_chain(LINKS)}},
    }  # fmt: skip


SMALL = {
    "messages": [{"role": "user", "content": "Give me a number."}],
    "max_tokens": 8,
    "structured_outputs": {"regex": "[0-9]{3}"},
}


async def test_crash_classes_are_400s_and_the_worker_lives_on(worker, aiohttp_client, monkeypatch):
    client = await aiohttp_client(make_app(worker))
    for name, body in bodies().items():
        resp = await client.post("/v1/chat/completions", json=body)
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["code"] == "invalid_grammar", (name, error)
        assert "at most" in error["message"], (name, error)
    pool = client.app[GRAMMARS].pool
    assert pool.crashes == 0  # refused before compiling

    monkeypatch.setattr("pd.worker.text.grammar.check_limits", lambda kind, spec: None)
    for name, body in bodies().items():
        before = pool.pids()
        resp = await client.post("/v1/chat/completions", json=body)
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["code"] == "invalid_grammar", (name, error)
        assert "crashed the grammar compiler (killed by SIGSEGV)" in error["message"], error
        resp = await client.post("/v1/chat/completions", json=SMALL)
        text = (await resp.json())["choices"][0]["message"]["content"]
        assert resp.status == 200 and text.isdigit() and len(text) == 3, text
        assert pool.pids() != before and len(pool.pids()) == 2
        assert (await client.get("/health")).status == 200
    assert pool.crashes == 3
    await wait_idle(worker)
    assert_all_pages_free(worker)
