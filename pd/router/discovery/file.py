"""`--discovery file`: the workers listed in a file, one a line, `ROLE URL` (role `prefill`,
`decode` or `both`; blank lines and `#` comments skipped), read again whenever it changes. The
simplest hand-off to any orchestrator: it rewrites the file (atomically, by a rename), the router
follows. A file that cannot be read or parsed keeps the last good list (logged): a half-written
file never empties the cluster."""

from __future__ import annotations

import asyncio
import logging
import os

from pd.registration import normalize_url
from pd.router.config import POOLS
from pd.router.discovery.sync import WorkerSet
from pd.router.registry import Registry

log = logging.getLogger("pd.router")
MISSING = (-1, -1, -1)  # the stamp of a file that is not there


def parse_worker_file(text: str) -> dict[str, str]:
    """{url: role} of a worker file; ValueError names the first bad line."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or parts[0] not in POOLS:
            raise ValueError(f"line {n}: expected 'ROLE URL' with ROLE one of {', '.join(POOLS)}")
        try:
            url = normalize_url(parts[1])
        except ValueError as e:
            raise ValueError(f"line {n}: {e}") from None
        if url in out and out[url] != parts[0]:
            raise ValueError(f"line {n}: {url} is listed as {out[url]} and as {parts[0]}")
        out[url] = parts[0]
    return out


class FileDiscovery:
    def __init__(self, path: str, registry: Registry, interval_s: float = 1.0) -> None:
        self.path = path
        self.interval_s = interval_s
        self.workers = WorkerSet(registry, f"discovery file {path}")
        self._seen: tuple[int, int, int] | None = None  # (mtime_ns, size, inode) read last
        self.errors = 0  # reads that failed or did not parse (the last list kept)

    def sync(self) -> None:
        """Read the file if it changed since the last look, and apply it (each error is logged
        once, until the file changes)."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError as e:
            stamp = MISSING
            why: Exception | None = e
        else:
            why = None
        if stamp == self._seen:
            return
        self._seen = stamp
        if why is None:
            try:
                with open(self.path, encoding="utf-8") as f:
                    wanted = parse_worker_file(f.read())
            except (OSError, ValueError, UnicodeDecodeError) as e:
                why = e
        if why is not None:
            self.errors += 1
            log.error("discovery file %s: %s (the last list is kept)", self.path, why)
            return
        self.workers.apply(wanted)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.sync()
