"""Traces in the shape of the public Mooncake traces: one JSON object per line with `timestamp`
(ms from the trace's start), `input_length`, `output_length` and `hash_ids` (ids of 512-token
blocks: equal ids are equal token blocks, so the trace's prefix sharing is reproduced)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from pd.bench.serve.text import TokenText
from pd.bench.serve.workloads import Job, Turn

BLOCK_TOKENS = 512


class TraceError(ValueError):
    pass


@dataclass(frozen=True)
class TraceEntry:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace(lines: list[str], source: str = "trace") -> list[TraceEntry]:
    entries = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{n}"
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object")
        try:
            entry = TraceEntry(
                float(_number(obj, "timestamp", where)),
                int(_number(obj, "input_length", where)),
                int(_number(obj, "output_length", where)),
                tuple(int(h) for h in _ids(obj.get("hash_ids", []), where)),
            )
        except (TypeError, ValueError) as e:
            raise TraceError(f"{where}: {e}") from None
        if entry.timestamp_ms < 0 or entry.input_length < 1 or entry.output_length < 1:
            raise TraceError(f"{where}: timestamp must be >= 0 and lengths >= 1")
        entries.append(entry)
    if not entries:
        raise TraceError(f"{source}: no requests in the trace")
    return entries


def read_trace(path: str) -> list[TraceEntry]:
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
    return parse_trace(lines, path)


def trace_jobs(entries: list[TraceEntry], text: TokenText, time_scale: float = 1.0) -> list[Job]:
    """One completion per entry, started at its timestamp (times `time_scale`) from the first."""
    t0 = min(e.timestamp_ms for e in entries)
    jobs = []
    for i, e in enumerate(entries):
        words: list[str] = []
        for h in e.hash_ids:
            words.extend(text.block_words(f"trace:{h}", BLOCK_TOKENS))
            if len(words) >= e.input_length:
                break
        if len(words) < e.input_length:  # past the trace's blocks: words of this request alone
            words.extend(text.block_words(f"trace-request:{i}", e.input_length - len(words)))
        prompt = "".join(words[: e.input_length])
        turn = Turn(e.output_length, prompt=prompt, input_len=e.input_length)
        jobs.append(Job(f"t{i}", [turn], True, at_s=(e.timestamp_ms - t0) / 1000 * time_scale))
    return jobs


def _number(obj: dict, name: str, where: str) -> float:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"{where}: '{name}' must be a number, got {value!r}")
    return value


def _ids(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in value
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    return value
