"""Apply a discovered set of workers to the registry: add the new ones, remove the ones gone.

A worker removed gets no new request; the streams it serves go on to their end (the proxy holds
its own reference), as a drain does. Only workers this set added are ever removed: a worker
given by flag, registered by itself or added through the admin API stays."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pd.registration import normalize_url
from pd.router.registry import Registry

log = logging.getLogger("pd.router")


class WorkerSet:
    def __init__(self, registry: Registry, source: str) -> None:
        self.registry = registry
        self.source = source  # named in the log lines
        self.owned: dict[str, str] = {}  # url -> role, the workers this set added
        self.changes = 0  # workers added, re-roled or removed

    def apply(self, wanted: Mapping[str, str]) -> None:
        """Make the registry hold `wanted` ({url: role}) of the workers this set owns."""
        wanted = {normalize_url(u): r for u, r in wanted.items()}
        for url in [u for u in self.owned if u not in wanted]:
            role = self.owned.pop(url)
            w = self.registry.find(url)
            if w is not None and w.role == role:
                self.registry.remove(url)
                self.changes += 1
                log.info("%s: %s worker %s removed (its streams finish)", self.source, role, url)
        for url, role in wanted.items():
            w = self.registry.find(url)
            if self.owned.get(url) == role and w is not None and w.role == role:
                continue
            if w is not None and url not in self.owned and w.role == role:
                continue  # there already (a flag, or it registered): not this set's to remove
            self.registry.add(url, role)
            self.owned[url] = role
            self.changes += 1
            log.info("%s: %s worker %s added", self.source, role, url)
