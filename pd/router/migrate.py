"""Migration of a broken stream (docs/migration.md §4): how the router continues the unfinished
choices of a stream elsewhere (`resume`), from what its `Tracker` (tracker.py) read.

On a break (connection error, EOF without [DONE], the worker ejected, silence past
--stream-idle-timeout-s, or `: pd-migrate`) `resume` continues each unfinished choice, one after
the other, on another worker by the usual plan, with the client's body for that choice plus
`pd_continuation`. A continuation leg's relay writes into a `_Leg` instead of the client: it
drops the chat role chunk, rewrites `id`, `created` and `index` to the first leg's, and keeps the
usage and [DONE] for the end (usage summed: prompt tokens once, completion tokens of every leg).
What it needs of the router is a `Migration`: a function that goes on with a leg, one that
asks a worker, and its settings.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

import orjson

from pd.protocol.names import CONTINUATION, REQUEST_ID_HEADER
from pd.router.exchange import Exchange
from pd.router.tracker import Tracker
from pd.signing import sign_continuation
from pd.tracing import NO_TRACING, Tracing

if TYPE_CHECKING:
    from pd.router.metrics import RouterMetrics
    from pd.router.worker import Worker

log = logging.getLogger("pd.router")

Emit = Callable[[bytes], Awaitable[None]]


class _Leg:
    """Stands in for the client's response in a continuation leg's relay (`Exchange.sink`)."""

    def __init__(self, emit: Emit, head: dict[str, Any], index: int, include_usage: bool) -> None:
        self.emit = emit
        self.head = head  # the first leg's id and created
        self.index = index
        self.include_usage = include_usage  # the client's events carry "usage": null
        self.buf = b""
        self.first_at: float | None = None  # when its first byte came
        self.done = False
        self.finished = False
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.status = 200

    async def prepare(self, request: Any) -> None:
        return None

    async def write(self, data: bytes) -> None:
        if self.first_at is None and data:
            self.first_at = perf_counter()
        self.buf += data
        *events, self.buf = self.buf.split(b"\n\n")
        out = []
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and self.error is None:
                    rewritten = self._rewrite(line[5:].strip())
                    if rewritten is not None:
                        out.append(rewritten)
        if out:
            await self.emit(b"".join(out))

    async def write_eof(self, data: bytes = b"") -> None:
        await self.write(data + (b"\n\n" if data and not data.endswith(b"\n\n") else b""))

    def _rewrite(self, payload: bytes) -> bytes | None:
        if payload == b"[DONE]":
            self.done = True
            return None
        obj = orjson.loads(payload)
        if not isinstance(obj, dict):
            return None
        if "error" in obj:
            self.error = obj
            return b"data: " + payload + b"\n\n"
        choices = obj.get("choices")
        if not choices:
            if isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            return None
        kept = []
        for c in choices:
            if not isinstance(c, dict) or self.finished:
                continue
            c = {**c, "index": self.index}
            delta = c.get("delta")
            if isinstance(delta, dict) and "role" in delta:
                delta = c["delta"] = {k: v for k, v in delta.items() if k != "role"}
                if (
                    delta in ({}, {"content": ""})
                    and c.get("finish_reason") is None
                    and not c.get("logprobs")
                ):
                    continue  # the continuation's role chunk
            if c.get("finish_reason") is not None:
                self.finished = True
            kept.append(c)
        if not kept:
            return None
        obj = {**obj, **self.head, "choices": kept}
        if not self.include_usage:
            obj.pop("usage", None)
        return b"data: " + orjson.dumps(obj) + b"\n\n"


@dataclass(slots=True)
class Outcome:
    """What `resume` ended with."""

    ok: bool
    usage: dict[str, Any] | None = None  # summed, when the client's stream still needs it
    error: dict[str, Any] | None = None  # a leg's error event (already sent), or None
    gone: bool = False  # the client went away
    why: str = ""  # when not ok: what the client is told
    head: dict[str, Any] = field(default_factory=dict)


def head_of(track: Tracker) -> dict[str, Any]:
    """The first leg's id, created, model and object (from its first event)."""
    try:
        obj = orjson.loads(track.head) if track.head else {}
    except orjson.JSONDecodeError:
        obj = {}
    if not isinstance(obj, dict):
        obj = {}
    return {k: obj[k] for k in ("id", "created", "model", "object") if k in obj}


def request_id(ex: Exchange, head: dict[str, Any]) -> str:
    return ex.request.headers.get(REQUEST_ID_HEADER) or str(head.get("id"))


class NoRoute(Exception):
    """No worker can take a leg now (the registry's refusal)."""


@dataclass(frozen=True)
class Migration:
    """What resuming a stream needs of the router: how to go on with a leg (`go_on`: by the
    usual plan, on a route the router picks; raising `NoRoute` when there is none) and how to ask
    one worker for a non-streaming answer (`ask`: its JSON, None when none answers), the limit of
    legs a choice, where migrations are counted, and the token that signs a continuation."""

    go_on: Callable[[Exchange], Awaitable[Any]]
    ask: Callable[[Exchange], Awaitable[dict[str, Any] | None]]
    limit: int
    metrics: RouterMetrics
    token: bytes | None
    tracing: Tracing = NO_TRACING


async def resume(m: Migration, ex: Exchange, track: Tracker, emit: Emit, reason: str) -> Outcome:
    """Continue every unfinished choice of `ex` after its stream (read by `track`) broke for
    `reason`; their events go out through `emit`. At most --migration-limit legs a choice."""
    t_break = perf_counter()
    head = head_of(track)
    ident: dict[str, Any] = {k: head[k] for k in ("id", "created") if k in head}
    n = ex.facts.n
    n = n if type(n) is int and n > 0 else 1
    ids = {i: track.ids_of(i) for i in range(n)}
    completion = track.count()
    prompt_usage: dict[str, Any] | None = None
    exclude: list[Worker] = [*ex.exclude, track.worker]
    broken = track.worker
    previous = ex.span  # the leg a leg continues (the request's own, first)
    first_reason = reason
    for i in range(n):
        if i in track.finished:
            continue
        # The limit is per choice: one break of an n-choice stream is one migration of each.
        legs, reason, broken = 0, first_reason, track.worker
        while True:
            if legs >= m.limit:
                return Outcome(False, why=f"choice {i}'s stream broke {legs + 1} times ({reason})")
            legs += 1
            m.metrics.migrations[reason] = m.metrics.migrations.get(reason, 0) + 1
            log.info(
                "request %s: choice %d migrates after %d tokens from %s (%s), migration %d",
                request_id(ex, head),
                i,
                len(ids[i]),
                broken.url,
                reason,
                legs,
            )
            sink = _Leg(emit, ident, i, ex.facts.include_usage)
            leg = _leg_exchange(ex, i, ids[i], exclude, sink, m.token)
            if ex.span.recording:  # the leg's span, linked to the leg whose stream broke
                leg.span = m.tracing.start(
                    "pd.migration",
                    ex.span,
                    links=[previous],
                    attributes={
                        "pd.reason": reason, "pd.choice": i, "pd.leg": legs,
                        "pd.tokens_before": len(ids[i]), "pd.broken_worker": broken.url,
                    },
                )  # fmt: skip
            try:
                with leg.span:
                    resp = await m.go_on(leg)
            except NoRoute as e:
                return Outcome(False, why=f"no worker to continue on: {e}")
            except ConnectionResetError:
                return Outcome(False, gone=True)
            previous = leg.span
            if resp is not sink:  # P's final answer, or the failure of every try
                body = getattr(resp, "body", None)
                if resp.status != 200 or not isinstance(body, bytes):
                    return Outcome(False, why=f"the continuation failed ({resp.status})")
                try:
                    await sink.write_eof(body)
                except ConnectionResetError:
                    return Outcome(False, gone=True)
            if sink.first_at is not None:
                wait = sink.first_at - t_break
                m.metrics.migration_wait.observe(wait)
                log.info(
                    "request %s: choice %d resumed %.3f s after the break, migration %d",
                    request_id(ex, head),
                    i,
                    wait,
                    legs,
                )
            if leg.status == "499":
                return Outcome(False, gone=True)
            if sink.error is not None:
                return Outcome(False, error=sink.error)
            lt = leg.track
            if lt is not None:
                ids[i] += lt.ids_of(0)
            if sink.usage is not None:
                prompt_usage = prompt_usage or sink.usage
                got = sink.usage.get("completion_tokens")
                completion += got if isinstance(got, int) else 0
            elif lt is not None:
                completion += lt.count()
            if sink.finished:
                break
            reason = leg.broken or "eof"
            if lt is not None:
                broken = lt.worker
                exclude.append(broken)
            t_break = perf_counter()
    if track.usage is not None:  # the first leg's usage went out already
        return Outcome(True, head=head)
    if not ex.facts.include_usage and ex.facts.stream:  # the client's stream has no usage chunk
        return Outcome(True, head=head)
    if prompt_usage is None:
        prompt_usage = await _probe_usage(m, ex, ids.get(0, []), exclude)
    prompt = prompt_usage.get("prompt_tokens") if prompt_usage else None
    prompt = prompt if isinstance(prompt, int) else 0
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    details = prompt_usage.get("prompt_tokens_details") if prompt_usage else None
    if details is not None:
        usage["prompt_tokens_details"] = details
    return Outcome(True, usage=usage, head=head)


def _leg_exchange(
    ex: Exchange, i: int, ids: list[int], exclude: list[Worker], sink: _Leg, token: bytes | None
) -> Exchange:
    body = {
        **ex.facts.body,
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        CONTINUATION: {"output_token_ids": ids},
    }
    seed = ex.facts.seed
    if seed is not None and ex.facts.n > 1:
        body["seed"] = seed + i  # the seed choice i was sampled with (engine/fork.py)
    facts = dataclasses.replace(
        ex.facts,
        body=sign_continuation(token, body),
        stream=True,
        include_usage=True,
        n=1,
        seed=body.get("seed"),
    )
    return Exchange(
        ex.request,
        facts,
        perf_counter(),
        sink=sink,
        leg=True,
        exclude=tuple(exclude),
    )


async def _probe_usage(
    m: Migration, ex: Exchange, ids: list[int], exclude: list[Worker]
) -> dict[str, Any] | None:
    """Every choice finished but the usage never came: ask a worker (P, or a co-located one)
    for choice 0's continuation with no budget left (it ends at once, no token) and take its
    usage's prompt tokens. None when no worker answers."""
    body = {**ex.facts.body, "n": 1, "stream": False, "max_tokens": len(ids)}
    body.pop("stream_options", None)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = len(ids)
    body[CONTINUATION] = {"output_token_ids": ids}
    facts = dataclasses.replace(
        ex.facts, body=sign_continuation(m.token, body), stream=False, include_usage=False, n=1
    )
    answer = await m.ask(Exchange(ex.request, facts, perf_counter(), exclude=tuple(exclude)))
    usage = answer.get("usage") if isinstance(answer, dict) else None
    return usage if isinstance(usage, dict) else None
