"""The router decides before it relays: `Proxy.plan` (route, workers, bodies) makes no I/O, and
every phase's tries go through one helper, `Proxy.retry`."""

from __future__ import annotations

from typing import Any

import pytest

from pd.router.config import RouterConfig
from pd.router.exchange import Exchange, RequestFacts
from pd.router.failure import Failure
from pd.router.metrics import RouterMetrics
from pd.router.prefix_index import PromptKey
from pd.router.proxy import KV, Plan, Proxy
from pd.router.registry import Registry
from pd.router.worker import Worker

URLS = {
    "prefill": ("http://p1:1", "http://p2:1"),
    "decode": ("http://d1:1", "http://d2:1"),
    "worker": ("http://w1:1", "http://w2:1", "http://w3:1"),
}


def proxy(**kw: Any) -> Proxy:
    cfg = RouterConfig(**{**URLS, "policy": "round-robin", "local_prefill_max_tokens": 0, **kw})
    registry = Registry(cfg)
    for pool in registry.pools.values():
        for w in pool.workers.values():
            pool.set_healthy(w, True)
    return Proxy(cfg, registry, RouterMetrics(registry), health=None)  # type: ignore[arg-type]


def exchange(body: dict[str, Any], prompt: bytes = b"hi", chat: bool = False) -> Exchange:
    facts = RequestFacts(
        path="/v1/completions",
        body=body,
        chat=chat,
        stream=bool(body.get("stream")),
        include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        max_tokens=body.get("max_tokens", body.get("max_completion_tokens")),
        n=body.get("n") or 1,
        seed=body.get("seed"),
        prompt_logprobs=body.get("prompt_logprobs") is not None
        or (body.get("echo") is True and body.get("logprobs") is not None),
        key=None,
        prompt=PromptKey.of(prompt),
        tokens=len(prompt) // 4 + 1,
        headers={},
    )
    return Exchange(None, facts, 0.0)  # type: ignore[arg-type]  # neither plan nor retry reads it


BODY = {"model": "m", "prompt": "hi", "max_tokens": 8}


# ------------------------------------------------------------------------------ plan


def test_a_pd_plan_says_what_p_and_d_get_before_anything_is_sent():
    px = proxy()
    plan = px.plan(exchange(BODY), "pd")
    assert isinstance(plan, Plan) and plan.route == "pd" and plan.decode is None
    assert not plan.final
    assert plan.prefill == {
        **BODY,
        "stream": False,
        "max_tokens": 1,
        KV: {"do_remote_decode": True, "max_tokens": 8},
    }
    # D (and a co-located worker) always streams: a client without one gets it collected.
    assert plan.stream == {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    streamed = {**BODY, "stream": True, "stream_options": {"include_usage": False}}
    assert px.plan(exchange(streamed), "pd").stream == streamed
    assert not any(w.inflight for w in px.registry)  # nothing charged: no worker is tried yet


def test_a_pd_plan_for_one_token_is_p_alone_and_keeps_the_clients_token_field():
    plan = proxy().plan(exchange({**BODY, "max_tokens": 1}), "pd")
    assert plan.final and KV not in plan.prefill
    body = {
        "model": "m",
        "prompt": "hi",
        "max_completion_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    p_body = proxy().plan(exchange(body), "pd").prefill
    assert p_body["max_completion_tokens"] == 1 and p_body["max_tokens"] == 1
    assert p_body["stream"] is False and "stream_options" not in p_body


def test_a_short_prompt_plans_decode_local_on_the_d_the_policy_picked():
    px = proxy(local_prefill_max_tokens=16)
    plan = px.plan(exchange(BODY), "pd")
    assert plan.route == "local" and plan.decode is px.registry.decode.workers["http://d1:1"]
    assert plan.prefill is not None  # the way through P, should D fail before its first byte
    # A prompt D lacks more of goes through P, and that D is the first one tried after it.
    plan = px.plan(exchange(BODY, prompt=b"x" * 4096), "pd")
    assert plan.route == "pd" and plan.decode is px.registry.decode.workers["http://d2:1"]


def test_a_colocated_plan_sends_the_stream_body_and_no_prefill():
    plan = proxy().plan(exchange(BODY), "both")
    assert plan.route == "both" and plan.prefill is None and plan.decode is None
    assert plan.stream["stream"] is True


# ------------------------------------------------------------------------------ retry


def failing(status: int, log: list):
    """An attempt that fails with `status` (a 400 is about the request: no retry mends it)."""

    async def attempt(w: Worker) -> Failure:
        log.append((w.url, w.inflight, w.inflight_tokens))
        return Failure(status, b"{}", None, status != 400)

    return attempt


async def test_retry_tries_each_worker_once_charged_and_counts_the_retries():
    px = proxy(max_retries=5)
    pool = px.registry.both
    log: list = []
    out = await px.retry(pool, exchange(BODY), failing(503, log), charge=lambda w: 7)
    # Three workers, each once, each charged while its try ran and released after.
    assert sorted(url for url, _, _ in log) == sorted(URLS["worker"])
    assert {(n, t) for _, n, t in log} == {(1, 7)}
    assert not any(w.inflight or w.inflight_tokens for w in pool.workers.values())
    assert px.metrics.retries["both"] == 2
    assert isinstance(out, Failure) and out.status == 503  # the last failure


async def test_retry_stops_at_max_retries_and_at_a_failure_no_other_worker_can_mend():
    px = proxy(max_retries=1)
    log: list = []
    await px.retry(px.registry.both, exchange(BODY), failing(502, log))
    assert len(log) == 2 and px.metrics.retries["both"] == 1
    log.clear()
    out = await px.retry(px.registry.both, exchange(BODY), failing(400, log))
    assert len(log) == 1 and isinstance(out, Failure) and out.status == 400


async def test_retry_returns_the_first_success_and_prefers_a_healthy_first_choice():
    px = proxy()
    pool = px.registry.decode
    d2 = pool.workers["http://d2:1"]
    seen: list[str] = []

    async def attempt(w: Worker) -> str:
        seen.append(w.url)
        return "served"

    assert await px.retry(pool, exchange(BODY), attempt, first=d2) == "served"
    pool.set_healthy(d2, False)
    assert await px.retry(pool, exchange(BODY), attempt, first=d2) == "served"
    assert seen == ["http://d2:1", "http://d1:1"] and px.metrics.retries["decode"] == 0


async def test_retry_with_no_healthy_worker_is_a_503_and_before_can_end_the_phase():
    px = proxy()
    pool = px.registry.both
    for w in list(pool.workers.values()):
        pool.set_healthy(w, False)
    out = await px.retry(pool, exchange(BODY), failing(502, []))
    assert isinstance(out, Failure) and out.status == 503 and out.retry_after == "1"
    calls: list[int] = []

    async def before() -> str | None:
        calls.append(1)
        return "answered ahead"  # e.g. P's answer was final: no worker of this pool is needed

    assert await px.retry(pool, exchange(BODY), failing(502, []), before=before) == (
        "answered ahead"
    )
    assert calls == [1]


async def test_retry_releases_the_charge_when_the_attempt_is_cancelled():
    import asyncio

    px = proxy()
    pool = px.registry.both

    async def attempt(w: Worker) -> str:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await px.retry(pool, exchange(BODY), attempt, charge=lambda w: 3)
    assert not any(w.inflight or w.inflight_tokens for w in pool.workers.values())


def test_max_tokens_0_is_p_alone_with_0_and_prompt_logprobs_never_go_decode_local():
    plan = proxy().plan(exchange({**BODY, "max_tokens": 0, "echo": True, "logprobs": 1}), "pd")
    assert plan.final and KV not in plan.prefill and plan.prefill["max_tokens"] == 0
    px = proxy(local_prefill_max_tokens=16)  # a short prompt: decode-local, unless it asks for
    assert px.plan(exchange(BODY), "pd").route == "local"  # the prompt's logprobs
    for asks in ({"echo": True, "logprobs": 0}, {"prompt_logprobs": 2}):
        plan = px.plan(exchange({**BODY, **asks}), "pd")
        assert plan.route == "pd" and plan.decode is None and not plan.final
    assert px.plan(exchange({**BODY, "echo": True}), "pd").route == "local"  # echo alone: text
