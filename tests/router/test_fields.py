"""The router applies the workers' field table: refused and unknown fields are 400s before any
worker sees them, and with --ignore-unknown-fields an unknown field is dropped on the way."""

from __future__ import annotations

import pytest

from pd.protocol import FIELDS, REFUSED
from tests.router.conftest import CHAT, COMPLETION

REFUSED_CHAT = sorted(
    n for n, r in FIELDS.items() if r.status == REFUSED and r.endpoint != "completions"
)


@pytest.mark.parametrize("name", REFUSED_CHAT)
async def test_a_refused_field_is_a_400_and_reaches_no_worker(stub, router, name):
    p, d = await stub("prefill"), await stub("decode")
    client = await router(prefill=[p], decode=[d])
    resp = await client.post("/v1/chat/completions", json={**CHAT, name: "on"})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "unsupported_parameter", error
    assert error["param"] == name and not p.requests and not d.requests


async def test_unknown_fields_are_refused_or_dropped_before_the_workers(stub, router):
    w = await stub("both")
    client = await router(worker=[w])
    resp = await client.post("/v1/completions", json={**COMPLETION, "mystery": 1})
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "unknown_parameter"
    lenient = await router(worker=[w], ignore_unknown_fields=True)
    resp = await lenient.post("/v1/completions", json={**COMPLETION, "mystery": 1})
    assert resp.status == 200
    assert w.requests and "mystery" not in w.requests[-1]  # the worker would refuse it
