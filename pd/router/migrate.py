"""Migration of a broken stream (docs/migration.md §4): what the router reads of every stream it
relays (`Tracker`), and how it continues the unfinished choices elsewhere (`resume`).

Every stream worker is asked for `X-PD-Token-Ids: 1`, so its events carry `: pd-ids` comment
lines. The relay hands each chunk to `Tracker.feed`, which returns what goes to the client: whole
events only (a trailing partial event waits for the rest, so that a break never leaves half an
event with the client), without the `: pd-` lines. Per chunk that is a suffix check, one split at
the `: pd-` lines (a chunk with none goes out as it came), a partition per ids line and one scan
for a finish reason. Nothing is parsed unless the stream migrates: the ids lines are kept as
bytes, and so are the first data line (its `id`, `created`) and those with a finish reason or,
after one, the usage.

On a break (connection error, EOF without [DONE], the worker ejected, silence past
--stream-idle-timeout-s, or `: pd-migrate`) `resume` continues each unfinished choice, one after
the other, on another worker by the usual plan, with the client's body for that choice plus
`pd_continuation`. A continuation leg's relay writes into a `_Leg` instead of the client: it
drops the chat role chunk, rewrites `id`, `created` and `index` to the first leg's, and keeps the
usage and [DONE] for the end (usage summed: prompt tokens once, completion tokens of every leg).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from pd.protocol import APIError
from pd.signing import CONTINUATION, sign_continuation

if TYPE_CHECKING:
    from pd.router.proxy import Exchange, Proxy
    from pd.router.worker import Worker

log = logging.getLogger("pd.router")

TOKEN_IDS_HEADER = "X-PD-Token-Ids"
_PD = b": pd-"
_IDS = b": pd-ids "
_AT_PD = b"\n: pd-"  # a `: pd-` line (at a line's start: JSON has no raw newline)
_AT_IDS = b"\n: pd-ids "
_FINISH = b'"finish_reason":"'
_USAGE = b'"usage":{'


class Tracker:
    """What the router reads of one relayed stream, chunk by chunk (see the module's doc)."""

    __slots__ = ("worker", "on_drain", "carry", "head", "lines", "ends", "migrate")

    def __init__(self, worker: Worker, on_drain: Callable[[], None] | None = None) -> None:
        self.worker = worker
        self.on_drain = on_drain  # called once, when `: pd-migrate` comes
        self.carry = b""  # a trailing partial event, held back
        self.head: bytes | None = None  # the first data line
        # The `: pd-ids` lines as they came, from their "ids <choice> <id> ..." on at least.
        self.lines: list[bytes] = []
        # The data lines that carried a finish reason or, after one, the usage (parsed only on
        # a migration: `finished`, `usage`).
        self.ends: list[bytes] = []
        self.migrate = False  # `: pd-migrate` came

    def feed(self, chunk: bytes) -> bytes:
        """The next chunk read; returns the bytes to relay (whole events, no `: pd-` line)."""
        # NOTE: per chunk, no `x in chunk` and few startswith/find. In CPython 3.11 `x in
        # chunk` first tries x as an int (a TypeError raised and cleared): ~1,600 instructions
        # more than `chunk.partition(x)[1]`; find and startswith parse their arguments by a
        # format string: ~600 more; partition, split and slices take theirs directly. The usual
        # chunk (one event) costs ~6,500 instructions here (callgrind: `pd-bench tracker`).
        if self.carry or chunk[-2:] != b"\n\n":
            chunk = self._whole(chunk)
        parts = chunk.split(_AT_PD)
        if len(parts) > 1:
            chunk = self._strip(chunk, parts)
        elif chunk[:9] == _IDS:  # the usual chunk: one event, its ids line first
            line, _, rest = chunk.partition(b"\n")
            if rest[0] == 10:  # (a newline: an ids line alone in its event)
                chunk = self._strip_lines(chunk)
            else:
                self.lines.append(line)
                chunk = rest
        elif chunk[:5] == _PD:
            chunk = self._strip_lines(chunk)
        if self.head is None:
            at = chunk.find(b"data: {")
            if at >= 0:
                self.head = chunk[at + 6 : chunk.find(b"\n", at)]
        if chunk.partition(_FINISH)[1] or (self.ends and chunk.partition(_USAGE)[1]):
            self._keep_ends(chunk)
        return chunk

    def _whole(self, chunk: bytes) -> bytes:
        """Hold back a trailing partial event; returns the whole events, with any held before."""
        if self.carry:
            chunk, self.carry = self.carry + chunk, b""
        cut = chunk.rfind(b"\n\n") + 2
        cut = 0 if cut == 1 else cut  # no event boundary at all: hold it all
        chunk, self.carry = chunk[:cut], chunk[cut:]
        return chunk

    def _strip(self, chunk: bytes, parts: list[bytes]) -> bytes:
        """Whole events less their `: pd-` lines, given `chunk.split(_AT_PD)`. The usual shape
        (each such line an ids line before its data line) by a partition of each part; any
        other by `_strip_lines`."""
        if chunk.count(_AT_IDS) != len(parts) - 1:  # a `: pd-` line of another kind
            return self._strip_lines(chunk)
        lines = self.lines
        before = len(lines)
        if parts[0][:5] == _PD:  # the chunk's first line is one
            line, _, rest = parts[0].partition(b"\n")
            if line[:9] != _IDS or not rest or rest[0] == 10:
                return self._strip_lines(chunk)
            lines.append(line)
            parts[0] = rest
        # Each other part: "ids <choice> <id> ...\ndata: ...": what follows its ids line is
        # kept, joined to the part before by the newline the split took.
        for i in range(1, len(parts)):
            line, _, rest = parts[i].partition(b"\n")
            if not rest or rest[0] == 10:  # an ids line with no data line after it
                del lines[before:]
                return self._strip_lines(chunk)
            lines.append(line)
            parts[i] = rest
        return b"\n".join(parts)

    def _strip_lines(self, chunk: bytes) -> bytes:
        """Any shape, line by line: an event left with no line at all is dropped whole."""
        out = []
        for event in chunk.split(b"\n\n")[:-1]:  # (whole events: the last part is empty)
            kept = []
            for line in event.split(b"\n"):
                if not line.startswith(_PD):
                    kept.append(line)
                elif line.startswith(_IDS):
                    self.lines.append(line)
                elif line.split(b" ", 2)[1] == b"pd-migrate" and not self.migrate:
                    self.migrate = True
                    if self.on_drain is not None:
                        self.on_drain()
            if kept:
                out.append(b"\n".join(kept))
        return b"\n\n".join(out) + b"\n\n" if out else b""

    def _keep_ends(self, chunk: bytes) -> None:
        """Keep the data lines with a finish reason and, once one came, with the usage."""
        for marker in (_FINISH, _USAGE):
            at = chunk.find(marker)
            while at >= 0:
                begin = chunk.rfind(b"\n", 0, at) + 1
                end = chunk.find(b"\n", at)  # (whole events: a newline follows)
                self.ends.append(chunk[begin:end])
                at = chunk.find(marker, end)
            if not self.ends:  # no finish reason yet: a usage is not the stream's end
                return

    @property
    def finished(self) -> set[int]:
        """The choices whose finish reason was relayed."""
        out: set[int] = set()
        for obj in map(_data, self.ends):
            for c in (obj or {}).get("choices") or ():
                if isinstance(c, dict) and c.get("finish_reason") is not None:
                    index = c.get("index", 0)
                    out.add(index if type(index) is int else 0)
        return out

    @property
    def usage(self) -> dict[str, Any] | None:
        """The usage relayed after a finish reason (the last one), or None."""
        for obj in map(_data, reversed(self.ends)):
            if obj is not None and isinstance(obj.get("usage"), dict):
                return obj["usage"]
        return None

    def ids_of(self, index: int) -> list[int]:
        """The token ids relayed for choice `index` (parsed only now: on a migration)."""
        out: list[int] = []
        for line in self.lines:
            words = line.partition(b"ids ")[2].split()
            if words and words[0].isdigit() and int(words[0]) == index:
                out += map(int, words[1:])
        return out

    def count(self) -> int:
        """Tokens relayed, every choice together."""
        return sum(len(line.partition(b"ids ")[2].split()) - 1 for line in self.lines)


def _data(line: bytes) -> dict[str, Any] | None:
    """The JSON object of a data line, or None."""
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
    `reason`; their events go out through `emit`. At most --migration-limit legs a choice."""
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
    first_reason = reason
    for i in range(n):
        if i in track.finished:
            continue
        # The limit is per choice: one break of an n-choice stream is one migration of each.
        legs, reason, broken = 0, first_reason, track.worker
        while True:
            if legs >= proxy.cfg.migration_limit:
                return Outcome(False, why=f"choice {i}'s stream broke {legs + 1} times ({reason})")
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
            leg = _leg_exchange(ex, i, ids[i], exclude, sink, proxy.token)
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
    ex: Exchange, i: int, ids: list[int], exclude: list[Worker], sink: _Leg, token: bytes | None
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
        body=sign_continuation(token, body),
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
    body = sign_continuation(proxy.token, body)
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
