"""Migration of a broken stream (docs/migration.md §4): what the router reads of every stream it
relays (`Tracker`), and how it continues the unfinished choices elsewhere (`resume`).

Every stream worker is asked for `X-PD-Token-Ids: 1`, so its events carry `: pd-ids` comment
lines. The relay hands each chunk to `Tracker.feed`, which returns what goes to the client: whole
events only (a trailing partial event waits for the rest, so that a break never leaves half an
event with the client), without the `: pd-` lines. Per chunk that is a suffix check and two byte
searches; the ids lines are kept as bytes (parsed into ints only on a migration),
and the first leg's events are never parsed but the first one (its `id`) and a finishing one.

On a break (connection error, EOF without [DONE], the worker ejected, silence past
--stream-idle-timeout-s, or `: pd-migrate`) `resume` continues each unfinished choice, one after
the other, on another worker by the usual plan, with the client's body for that choice plus
`pd_continuation`. A continuation leg's relay writes into a `_Leg` instead of the client: it
drops the chat role chunk, rewrites `id`, `created` and `index` to the first leg's, and keeps the
usage and [DONE] for the end (usage summed: prompt tokens once, completion tokens of every leg).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from pd.protocol import APIError

if TYPE_CHECKING:
    from pd.router.proxy import Exchange, Proxy
    from pd.router.worker import Worker

log = logging.getLogger("pd.router")

TOKEN_IDS_HEADER = "X-PD-Token-Ids"
CONTINUATION = "pd_continuation"
_PD_LINE = re.compile(rb"^: pd-([a-z]+) ?([^\n]*)\n", re.M)
_FINISH = b'"finish_reason":"'


class Tracker:
    """What the router reads of one relayed stream, chunk by chunk (see the module's doc)."""

    __slots__ = ("worker", "on_drain", "carry", "head", "lines", "finished", "usage", "migrate")

    def __init__(self, worker: Worker, on_drain: Callable[[], None] | None = None) -> None:
        self.worker = worker
        self.on_drain = on_drain  # called once, when `: pd-migrate` comes
        self.carry = b""  # a trailing partial event, held back
        self.head: bytes | None = None  # the first data line
        self.lines: list[bytes] = []  # the `: pd-ids` lines' "<choice> <id> ...", as they came
        self.finished: set[int] = set()  # choices whose finish_reason came
        self.usage: dict[str, Any] | None = None  # the usage chunk's, once relayed
        self.migrate = False  # `: pd-migrate` came

    def feed(self, chunk: bytes) -> bytes:
        """The next chunk read; returns the bytes to relay (whole events, no `: pd-` line)."""
        if self.carry or chunk[-2:] != b"\n\n":
            chunk = self._whole(chunk)
        if chunk.startswith(b": pd-ids "):  # the usual chunk: one event, its ids line first
            nl = chunk.find(b"\n")
            if chunk.find(b": pd-", nl) < 0:
                self.lines.append(chunk[9:nl])
                chunk = chunk[nl + 1 :]
            else:
                chunk = self._strip(chunk)
        elif b": pd-" in chunk:
            chunk = self._strip(chunk)
        if self.head is None:
            at = chunk.find(b"data: {")
            if at >= 0:
                self.head = chunk[at + 6 : chunk.find(b"\n", at)]
        if _FINISH in chunk:
            self._finishes(chunk)
            if b'"usage":{' in chunk:
                self._usage(chunk)
        elif self.finished and b'"usage":{' in chunk:
            self._usage(chunk)
        return chunk

    def _whole(self, chunk: bytes) -> bytes:
        """Hold back a trailing partial event; returns the whole events, with any held before."""
        if self.carry:
            chunk, self.carry = self.carry + chunk, b""
        cut = chunk.rfind(b"\n\n") + 2
        cut = 0 if cut == 1 else cut  # no event boundary at all: hold it all
        chunk, self.carry = chunk[:cut], chunk[cut:]
        return chunk

    def _strip(self, chunk: bytes) -> bytes:
        for kind, rest in _PD_LINE.findall(chunk):
            if kind == b"ids":
                self.lines.append(rest)
            elif kind == b"migrate" and not self.migrate:
                self.migrate = True
                if self.on_drain is not None:
                    self.on_drain()
        out = _PD_LINE.sub(b"", chunk)
        # A comment-only event leaves its blank line behind.
        while out.startswith(b"\n"):
            out = out[1:]
        while b"\n\n\n" in out:
            out = out.replace(b"\n\n\n", b"\n\n")
        return out

    def _finishes(self, chunk: bytes) -> None:
        at = chunk.find(_FINISH)
        while at >= 0:
            obj = _event_at(chunk, at)
            for c in (obj or {}).get("choices") or ():
                if isinstance(c, dict) and c.get("finish_reason") is not None:
                    index = c.get("index", 0)
                    self.finished.add(index if type(index) is int else 0)
            at = chunk.find(_FINISH, chunk.find(b"\n", at) + 1 or len(chunk))

    def _usage(self, chunk: bytes) -> None:
        obj = _event_at(chunk, chunk.find(b'"usage":{'))
        if obj is not None and isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]

    def ids_of(self, index: int) -> list[int]:
        """The token ids relayed for choice `index` (parsed only now: on a migration)."""
        out: list[int] = []
        for line in self.lines:
            choice, *ids = line.split()
            if choice.isdigit() and int(choice) == index:
                out += map(int, ids)
        return out

    def count(self) -> int:
        """Tokens relayed, every choice together."""
        return sum(len(line.split()) - 1 for line in self.lines)


def _event_at(chunk: bytes, at: int) -> dict[str, Any] | None:
    """The JSON of the data line around position `at`, or None."""
    begin = chunk.rfind(b"\n", 0, at) + 1
    end = chunk.find(b"\n", at)
    line = chunk[begin : end if end >= 0 else None]
    if not line.startswith(b"data:"):
        return None
    try:
        obj = orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


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
    return ex.request.headers.get("X-Request-Id") or str(head.get("id"))


async def resume(proxy: Proxy, ex: Exchange, track: Tracker, emit: Emit, reason: str) -> Outcome:
    """Continue every unfinished choice of `ex` after its stream (read by `track`) broke for
    `reason`; their events go out through `emit`. At most --migration-limit legs a request."""
    t_break = perf_counter()
    head = head_of(track)
    ident: dict[str, Any] = {k: head[k] for k in ("id", "created") if k in head}
    n = ex.body.get("n") or 1
    n = n if type(n) is int and n > 0 else 1
    ids = {i: track.ids_of(i) for i in range(n)}
    completion = track.count()
    prompt_usage: dict[str, Any] | None = None
    exclude: list[Worker] = [*ex.exclude, track.worker]
    broken = track.worker
    legs = 0
    for i in range(n):
        if i in track.finished:
            continue
        while True:
            if legs >= proxy.cfg.migration_limit:
                return Outcome(False, why=f"the stream broke {legs + 1} times ({reason})")
            legs += 1
            proxy.metrics.migrations[reason] = proxy.metrics.migrations.get(reason, 0) + 1
            log.info(
                "request %s: choice %d migrates after %d tokens from %s (%s), migration %d",
                request_id(ex, head),
                i,
                len(ids[i]),
                broken.url,
                reason,
                legs,
            )
            sink = _Leg(emit, ident, i, ex.include_usage)
            leg = _leg_exchange(ex, i, ids[i], exclude, sink)
            try:
                route = proxy.registry.route()
            except APIError as e:
                return Outcome(False, why=f"no worker to continue on: {e}")
            try:
                resp = await proxy.handle(leg, route)
            except ConnectionResetError:
                return Outcome(False, gone=True)
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
                proxy.metrics.migration_wait.observe(wait)
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
    if not ex.include_usage and ex.stream:  # the client's stream has no usage chunk
        return Outcome(True, head=head)
    if prompt_usage is None:
        prompt_usage = await _probe_usage(proxy, ex, ids.get(0, []), exclude)
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
    ex: Exchange, i: int, ids: list[int], exclude: list[Worker], sink: _Leg
) -> Exchange:
    from pd.router.proxy import Exchange

    body = {
        **ex.body,
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        CONTINUATION: {"output_token_ids": ids},
    }
    seed = ex.body.get("seed")
    if type(seed) is int and (ex.body.get("n") or 1) > 1:
        body["seed"] = seed + i  # the seed choice i was sampled with (engine/fork.py)
    return Exchange(
        request=ex.request,
        path=ex.path,
        body=body,
        chat=ex.chat,
        stream=True,
        include_usage=True,
        max_tokens=ex.max_tokens,
        key=ex.key,
        prompt=ex.prompt,
        tokens=ex.tokens,
        headers=ex.headers,
        t0=perf_counter(),
        sink=sink,
        leg=True,
        exclude=tuple(exclude),
    )


async def _probe_usage(
    proxy: Proxy, ex: Exchange, ids: list[int], exclude: list[Worker]
) -> dict[str, Any] | None:
    """Every choice finished but the usage never came: ask a worker (P, or a co-located one)
    for choice 0's continuation with no budget left (it ends at once, no token) and take its
    usage's prompt tokens. None when no worker answers."""
    body = {**ex.body, "n": 1, "stream": False, "max_tokens": len(ids)}
    body.pop("stream_options", None)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = len(ids)
    body[CONTINUATION] = {"output_token_ids": ids}
    try:
        route = proxy.registry.route()
    except APIError:
        return None
    pool = proxy.registry.prefill if route == "pd" else proxy.registry.both
    w = pool.choose(ex.key, exclude, ex.prompt)
    if w is None:
        return None
    w.acquire(0)
    try:
        async with proxy.session.post(  # type: ignore[union-attr]
            w.url + ex.path,
            data=orjson.dumps(body),
            headers=ex.headers,
            timeout=proxy.release_timeout,
        ) as resp:
            data = await resp.read()
        answer = orjson.loads(data) if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        return None
    finally:
        w.release(0)
    usage = answer.get("usage") if isinstance(answer, dict) else None
    return usage if isinstance(usage, dict) else None
