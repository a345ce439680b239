"""The PD roles against stand-ins: a stub transfer manager and a stand-in model, real engine and
scheduler. P pins and hands off; D validates params before anything is pulled. Each role's
`admit` against a stand-in engine: what it queues, and what it refuses before tokenizing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from pd.kvcache.cache_manager import KVCacheManager
from pd.protocol import APIError, GenerationOptions, parse_request
from pd.transfer import TransferParams
from pd.worker.disagg import KV_POOL, CoLocated, Decode, DecodeSide, Prefill, PrefillSide
from pd.worker.disagg.contract import KV_LAYOUT
from pd.worker.engine import Capacity, Engine, Scheduler
from pd.worker.model import ModelConfig, SampleOutput
from tests.admit import add_remote

PAGE = 4
CONFIG = ModelConfig("m", "llama", 64, 16, 32, 2, 2, 1, 8, 1e4, 1e-5, 128, True)


class Runner:
    """Stands in for the ModelRunner: what the roles read, and a step that samples token 7."""

    config = CONFIG
    page_size = PAGE
    dtype = torch.float32
    kv_pools = [SimpleNamespace(buffer=torch.zeros(16, 2, 2, 1, PAGE, 8))]

    def execute(self, batch) -> SampleOutput:
        n = sum(batch.sample)
        return SampleOutput([7] * n, [None] * n, [None] * n)


class Sender:
    def __init__(self, slots, on_release) -> None:
        self.slots, self.on_release = slots, on_release

    def params(self) -> TransferParams:
        return TransferParams("127.0.0.1", 5555, "p-engine", "t-1", self.slots, 30.0)

    def abort(self, reason: str = "") -> None:
        self.on_release(self, "abort")


class Manager:
    def __init__(self, fail: bool = False) -> None:
        self.senders: list[Sender] = []
        self.fail = fail

    def create_sender(self, slots, on_release):
        if self.fail:
            raise RuntimeError("no bootstrap server")
        self.senders.append(Sender(slots, on_release))
        return self.senders[-1]


def make(hooks_for, num_pages: int = 16):
    scheduler = Scheduler(KVCacheManager(num_pages, PAGE), chunk_size=64, max_running=8)
    hooks = hooks_for(scheduler)
    engine = Engine(
        Runner(), scheduler, SimpleNamespace(eos_token_ids=frozenset({0}), decode=lambda *a, **k: "x", vocab_size=60),
        max_model_len=64, max_waiting=8, connector=hooks,
    )  # fmt: skip
    return engine, hooks


async def test_prefill_pins_pages_until_the_sender_releases_them():
    manager = Manager()
    engine, prefill = make(lambda s: PrefillSide(manager, Runner(), s, tp_size=1))
    engine.start()
    try:
        handle = add_remote(engine, prefill, list(range(1, 10)), GenerationOptions(max_tokens=1))
        delta = await asyncio.wait_for(handle.queue.get(), 5)
        assert delta.finish_reason == "length" and delta.token_ids == [7]
        kvp = handle.kv_transfer_params
        assert kvp["first_token_id"] == 7 and kvp["num_tokens"] == 9
        assert kvp["prompt_token_ids"] == list(range(1, 10))
        assert len(kvp["page_ids"][KV_POOL]) == 3 and kvp["page_size"] == PAGE
        assert engine.load().kv_pages_held == 3 and engine.integrity() == "ok"
        sender = manager.senders[0]
        sender.on_release(sender, "done")  # D pulled and said done
        assert engine.scheduler.cache.num_used == 0 and prefill.released == {"done": 1}
        assert engine.integrity() == "ok"
    finally:
        await engine.stop()


async def test_prefill_hand_off_failure_is_a_503_and_frees_the_pages():
    engine, prefill = make(lambda s: PrefillSide(Manager(fail=True), Runner(), s, tp_size=1))
    engine.start()
    try:
        handle = add_remote(engine, prefill, list(range(1, 10)), GenerationOptions(max_tokens=1))
        delta = await asyncio.wait_for(handle.queue.get(), 5)
        assert delta.error is not None and delta.error.status == 503
        assert engine.scheduler.cache.num_used == 0 and engine.integrity() == "ok"
    finally:
        await engine.stop()


def _params(**changes):
    params = dict(
        remote_engine_id="p", remote_host="127.0.0.1", remote_port=1, transfer_id="t",
        prompt_token_ids=[1, 2, 3, 4, 5], first_token_id=7, page_ids={KV_POOL: [0, 1]},
        num_tokens=5, page_size=PAGE, tp_size=1, kv_layout=KV_LAYOUT, dtype="float32",
        model_fingerprint=None, lease_ttl_s=30.0, pd_version=1,
    )  # fmt: skip
    params.update(changes)
    return params


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"page_size": 8}, "page_size"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"model_fingerprint": "elsewhere"}, "model_fingerprint"),
        ({"page_ids": {KV_POOL: [0]}}, "inconsistent"),
        ({"pd_version": 2}, "pd_version"),
    ],
)
def test_decode_refuses_params_that_do_not_match_it(changes, needle):
    engine, _ = make(lambda s: None)
    decode = DecodeSide(Manager(), Runner(), engine)
    good = _params(model_fingerprint=decode.contract.model_fingerprint)
    assert decode.validate(good).num_tokens == 5
    with pytest.raises(APIError, match=needle) as e:
        decode.validate({**good, **changes})
    assert e.value.status == 400


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"prompt_token_ids": [1, 2, 3, 4, 60]}, "out of the vocabulary"),  # vocab: 60
        ({"first_token_id": 64}, "out of the vocabulary"),
        ({"prompt_token_ids": [1, 2, 3, 4, -1]}, "prompt_token_ids is not"),
        ({"prompt_token_ids": [1, 2, 3, 4, 2**40]}, "prompt_token_ids is not"),
        ({"prompt_token_ids": [1, 2, 3, 4, "5"]}, "prompt_token_ids is not"),
        ({"prompt_token_ids": "12345"}, "prompt_token_ids is not"),
        ({"first_token_id": True}, "first_token_id is not"),
        ({"page_ids": [0, 1]}, "page_ids is not"),
        ({"page_ids": {KV_POOL: [0, None]}}, "page_ids is not"),
        ({"num_tokens": "5"}, "num_tokens is not"),
        ({"page_size": 0}, "page_size is not"),
        ({"remote_port": 70000}, "remote_port is not"),
        ({"lease_ttl_s": float("nan")}, "lease_ttl_s is not"),
        ({"first_token_logprobs": [0.5]}, "first_token_logprobs is not"),
        ({"first_token_logprobs": [-0.5, [[1, "x"]]]}, "first_token_logprobs is not"),
        ({"cached_tokens": -3}, "cached_tokens is not"),
        ({"transfer_id": 5}, "transfer_id is not"),
        ({"num_tokens": 64, "prompt_token_ids": [1] * 64, "page_ids": {KV_POOL: list(range(16))}},
         "context length"),
    ],
)  # fmt: skip
async def test_decode_refuses_malformed_params_with_a_400_and_touches_nothing(changes, needle):
    engine, _ = make(lambda s: None)
    engine.start()
    manager = Manager()
    decode = DecodeSide(manager, Runner(), engine)
    good = _params(model_fingerprint=decode.contract.model_fingerprint)
    with pytest.raises(APIError, match=needle) as e:
        decode.validate({**good, **changes})
    assert e.value.status == 400 and e.value.param == "kv_transfer_params"
    assert not engine.handles and engine.integrity() == "ok"
    await engine.stop()


def test_decode_validate_answers_any_params_with_a_400_or_sound_params():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tests.api_bodies import JSON_VALUES

    engine, _ = make(lambda s: None)
    decode = DecodeSide(Manager(), Runner(), engine)
    good = _params(model_fingerprint=decode.contract.model_fingerprint)

    @settings(max_examples=300, deadline=None, database=None)
    @given(st.dictionaries(st.sampled_from(sorted(good)), JSON_VALUES, max_size=4))
    def check(changes):
        try:
            kvp = decode.validate({**good, **changes})
        except APIError as e:
            assert e.status == 400 and e.param == "kv_transfer_params", e
            return
        assert all(0 <= t < decode.vocab_size for t in kvp.prompt_token_ids)
        assert kvp.num_tokens == len(kvp.prompt_token_ids) < engine.max_model_len

    check()


# ------------------------------------------------------------------------- the roles' admit


class QueueingEngine:
    """Stands in for the engine behind a role: records what it is asked to queue."""

    def __init__(self, max_model_len: int = 64) -> None:
        self.capacity = Capacity(max_model_len, PAGE, 64)
        self.queued: list[tuple[list[int], bool, str | None]] = []
        self.expected: list[str] = []  # the handles a prefill side was told to hand off

    def add(self, request):
        self.queued.append(
            (list(request.prompt_ids), request.budget_past_continuation, request.cache_salt)
        )
        return Handle(f"handle-{len(self.queued)}")


class Handle(str):
    """A stand-in handle: its own `seq`."""

    @property
    def seq(self):
        return self


class ExpectingSide:
    """Stands in for the prefill side: records the requests it is to hand off."""

    def __init__(self, engine: QueueingEngine) -> None:
        self.engine = engine

    def expect(self, seq) -> None:
        self.engine.expected.append(seq)


def prefill_role(engine: QueueingEngine) -> Prefill:
    return Prefill(engine, ExpectingSide(engine))  # type: ignore[arg-type]


def completion(**body):
    return parse_request("/v1/completions", {"prompt": "ab", **body})


def tokenized(ids=(1, 2, 3)):
    """A request's `prompt_ids`, recording whether the role awaited it."""
    calls = []

    async def prompt_ids():
        calls.append(1)
        return list(ids)

    return prompt_ids, calls


REMOTE = {"kv_transfer_params": {"do_remote_decode": True}}


async def test_each_role_queues_what_it_serves_with_the_salt():
    both, prefill = QueueingEngine(), QueueingEngine()
    ids, _ = tokenized()
    assert await CoLocated(both).admit(completion(cache_salt="s"), ids) == "handle-1"
    await prefill_role(prefill).admit(completion(), ids)  # no params: served as co-located
    await prefill_role(prefill).admit(completion(cache_salt="t", **REMOTE), ids)
    assert both.queued == [([1, 2, 3], False, "s")] and both.expected == []
    assert prefill.queued == [([1, 2, 3], False, None), ([1, 2, 3], True, "t")]
    assert prefill.expected == ["handle-2"]  # its KV goes to a decode worker


@pytest.mark.parametrize(
    "role, body, param",
    [
        (CoLocated, REMOTE, "kv_transfer_params"),
        (prefill_role, {"kv_transfer_params": {"do_remote_decode": "yes"}}, "kv_transfer_params"),
        (prefill_role, {**REMOTE, "stream": True}, "stream"),
        (prefill_role, {"kv_transfer_params": {"do_remote_decode": True, "max_tokens": 0}},
         "kv_transfer_params"),
    ],
)  # fmt: skip
async def test_roles_refuse_what_they_do_not_serve_before_tokenizing(role, body, param):
    engine = QueueingEngine()
    ids, calls = tokenized()
    with pytest.raises(APIError) as e:
        await role(engine).admit(completion(**body), ids)
    assert e.value.status == 400 and e.value.param == param
    assert not calls and not engine.queued


async def test_prefill_refuses_a_remote_decode_the_context_cannot_hold_after_tokenizing():
    engine = QueueingEngine(max_model_len=16)
    ids, calls = tokenized(range(1, 11))
    body = {"kv_transfer_params": {"do_remote_decode": True, "max_tokens": 7}}  # 10 + 7 > 16
    with pytest.raises(APIError) as e:
        await prefill_role(engine).admit(completion(max_tokens=1, **body), ids)
    assert e.value.code == "context_length_exceeded" and calls and not engine.queued


async def test_decode_pulls_with_params_and_prefills_here_without():
    engine = QueueingEngine()
    pulled = []

    async def admit(kvp, options, cache_salt=None, rules=None, n=1, choice_rules=None, priority=0):
        pulled.append((kvp, cache_salt))
        return "pulled"

    side = SimpleNamespace(engine=engine, validate=lambda raw, n=1, given=None: ("checked", raw), admit=admit)
    role = Decode(side)  # type: ignore[arg-type]
    ids, calls = tokenized()
    raw = {"transfer_id": "t"}
    assert await role.admit(completion(kv_transfer_params=raw, cache_salt="s"), ids) == "pulled"
    assert pulled == [(("checked", raw), "s")] and not calls  # D never re-tokenizes
    assert await role.admit(completion(), ids) == "handle-1"  # decode-local prefill
    assert engine.queued == [([1, 2, 3], False, None)]
