"""Silence timeouts for upstream streams, with one task for all of them.

aiohttp's `sock_read` timeout re-arms a timer on every packet received, which costs the relay a
share of its CPU worth saving (docs/EXPERIMENTS.md §23). Instead a stream bumps an integer per chunk
it reads, and one loop, every `period` seconds, closes the upstream response of any stream whose
count has not moved for `timeout` seconds (its pending read then fails, and the relay ends it as a
broken stream).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import aiohttp


class Watched(Protocol):
    reads: int  # bumped per chunk read
    timed_out: bool  # set when the watcher gives up on it


class IdleWatch:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.period = min(1.0, timeout / 4)
        # stream -> [upstream response, reads at the last change, time of the last change]
        self._streams: dict[Watched, list] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def watch(self, stream: Watched, upstream: aiohttp.ClientResponse) -> None:
        self._streams[stream] = [upstream, stream.reads, asyncio.get_running_loop().time()]

    def unwatch(self, stream: Watched) -> None:
        self._streams.pop(stream, None)

    def sweep(self, now: float) -> None:
        for stream, entry in list(self._streams.items()):
            if stream.reads != entry[1]:
                entry[1], entry[2] = stream.reads, now
            elif now - entry[2] >= self.timeout:
                del self._streams[stream]
                stream.timed_out = True
                entry[0].close()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.period)
            self.sweep(loop.time())
