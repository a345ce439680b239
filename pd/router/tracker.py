"""What the router reads of every stream it relays (`Tracker`), for a migration to continue it
(migrate.py; docs/migration.md §4).

Every stream worker is asked for `X-PD-Token-Ids: 1`, so its events carry `: pd-ids` comment
lines. The relay hands each chunk to `Tracker.feed`, which returns what goes to the client: whole
events only (a trailing partial event waits for the rest, so that a break never leaves half an
event with the client), without the `: pd-` lines. Per chunk that is a suffix check, one split at
the `: pd-` lines (a chunk with none goes out as it came), a partition per ids line and one scan
for a finish reason. Nothing is parsed unless the stream migrates: the ids lines are kept as
bytes, and so are the first data line (its `id`, `created`) and those with a finish reason or,
after one, the usage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from pd.protocol.names import MIGRATE_MARK, SSE_IDS, SSE_PD

if TYPE_CHECKING:
    from pd.router.worker import Worker


_PD, _IDS = SSE_PD, SSE_IDS
_AT_PD = b"\n" + SSE_PD  # a `: pd-` line (at a line's start: JSON has no raw newline)
_AT_IDS = b"\n" + SSE_IDS
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
        # chunk` first tries x as an int (a TypeError raised and cleared), and find and
        # startswith parse their arguments by a format string; partition, split and slices take
        # theirs directly. Against a chunk's whole cost here the difference is large (callgrind,
        # `pd-bench tracker`: docs/BENCHMARKS.md, "The relay's cost of migration, cut").
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
                elif line.split(b" ", 2)[1] == MIGRATE_MARK and not self.migrate:
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
