"""The worker registry: three pools (prefill, decode, both), each with its policy and its
prefix index (what the router expects each of its workers to have cached)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pd.protocol import APIError
from pd.registration import normalize_url
from pd.router.config import POOLS, RouterConfig
from pd.router.hist import DECISION_BUCKETS, Hist
from pd.router.policies import Policy, make_policy
from pd.router.prefix_index import BLOCK_BYTES, PrefixIndex, PromptKey, TokenEstimate
from pd.router.worker import Worker

log = logging.getLogger("pd.router")

# Not ready for these reasons, a worker gets nothing even when its whole pool is busy: it drains
# (leaving), it starts (its weights still loading), or it is a spare node's (parked).
NEVER_BUSY_FALLBACK = ("draining", "starting", "parked")


class Pool:
    def __init__(
        self,
        name: str,
        policy: Policy,
        index: PrefixIndex | None = None,
        estimate: TokenEstimate | None = None,
    ) -> None:
        self.name = name
        self.policy = policy
        self.index = index or PrefixIndex()
        self.estimate = estimate or TokenEstimate()
        self.workers: dict[str, Worker] = {}
        self.healthy: list[Worker] = []  # kept in step with the workers' `healthy` flags
        self.on_eject: Callable[[Worker], None] | None = None
        self.decision_s = Hist(DECISION_BUCKETS)  # the policy's time per choice
        self.all_busy = False  # no worker is ready: `healthy` holds the busy ones (_refresh)
        self.busy_choices = 0  # workers chosen while all were busy (a fallback, counted)

    def add(self, url: str) -> Worker:
        w = self.workers.get(url)
        if w is None:
            self.index.forget(url)  # a URL added again: a worker whose cache is unknown
            w = self.workers[url] = Worker(url, self.name)
            self.policy.rebuild(list(self.workers.values()))
            self._refresh()
        return w

    def remove(self, url: str) -> Worker | None:
        w = self.workers.pop(url, None)
        if w is not None:
            w.healthy = False
            self.index.forget(url)
            self.policy.rebuild(list(self.workers.values()))
            self._refresh()
        return w

    def set_healthy(self, w: Worker, ok: bool, reason: str | None = None) -> None:
        if w.healthy == ok or self.workers.get(w.url) is not w:
            return
        w.healthy = ok
        if ok:
            log.info("%s worker %s admitted", self.name, w.url)
        else:
            w.ejections += 1
            self.index.forget(w.url)  # its caches may be gone by the time it comes back
            log.warning("%s worker %s ejected: %s", self.name, w.url, reason)
            if self.on_eject:
                self.on_eject(w)
        self._refresh()
        if not ok:
            w.fail_inflight()

    def set_draining(self, w: Worker) -> None:
        """The worker said it drains (`: pd-migrate`): not ready, so no new request goes to
        it; it is not ejected and its other streams are not cut (each migrates when the worker
        ends it). Its health checks say when it is ready again."""
        if not w.ready or self.workers.get(w.url) is not w:
            return
        w.ready, w.not_ready = False, "draining"
        self.readiness_changed(w)

    def readiness_changed(self, w: Worker) -> None:
        """`w.ready` changed (its /health, or a `: pd-migrate`): new requests follow it."""
        if self.workers.get(w.url) is not w:
            return
        if w.ready:
            log.info("%s worker %s is ready again", self.name, w.url)
        else:
            log.warning("%s worker %s is not ready (%s): no new requests", self.name, w.url,
                        w.not_ready)  # fmt: skip
        self._refresh()

    def choose(
        self, key: str | None, exclude: Sequence[Worker] = (), prompt: PromptKey | None = None
    ) -> Worker | None:
        t0 = time.perf_counter()
        w = self.policy.choose(self.healthy, key, exclude, prompt)
        self.decision_s.observe(time.perf_counter() - t0)
        if w is not None and self.all_busy:
            self.busy_choices += 1
        return w

    # ------------------------------------------------------------------------ prefix index

    def expected_cached_bytes(self, w: Worker, prompt: PromptKey) -> int:
        return self.index.match(w.url, prompt.blocks) * BLOCK_BYTES

    def record(self, w: Worker, blocks: list[int]) -> None:
        """`w` now holds KV for these blocks (its cache keeps them until it evicts them).

        Only while `w` is healthy and still this pool's: a late answer of a worker ejected or
        removed meanwhile would record a cache that may be gone, for a URL nobody forgets."""
        if not w.healthy or self.workers.get(w.url) is not w:
            return
        cap = None
        load = w.load
        if load is not None and load.kv_page_size:
            capacity_tokens = load.kv_pages_total * load.kv_page_size
            cap = int(capacity_tokens * self.estimate.bytes_per_token / BLOCK_BYTES)
        self.index.insert(w.url, blocks, cap)

    def restarted(self, w: Worker) -> None:
        log.info("%s worker %s restarted: forgetting what it had cached", self.name, w.url)
        self.index.forget(w.url)

    def _refresh(self) -> None:
        """`healthy`: the workers new requests may go to: alive and ready; when none is ready,
        the alive ones that neither drain nor start (all busy: each queues what it gets, rather than the
        router refusing everything)."""
        alive = [w for w in self.workers.values() if w.healthy]
        ready = [w for w in alive if w.ready]
        self.healthy = ready or [w for w in alive if w.not_ready not in NEVER_BUSY_FALLBACK]
        self.all_busy = not ready and bool(self.healthy)


class Registry:
    def __init__(self, cfg: RouterConfig) -> None:
        self.estimate = TokenEstimate()  # one bytes-per-token ratio: one model behind the router
        self.pools = {}
        for name in POOLS:
            index = PrefixIndex(cfg.prefix_index_blocks, cfg.prefix_index_ttl_s)
            policy = make_policy(cfg.policy_of(name), cfg, index)
            self.pools[name] = Pool(name, policy, index, self.estimate)
        self.prefill = self.pools["prefill"]
        self.decode = self.pools["decode"]
        self.both = self.pools["both"]
        for url in cfg.prefill:
            self.prefill.add(url)
        for url in cfg.decode:
            self.decode.add(url)
        for url in cfg.worker:
            self.both.add(url)

    def __iter__(self) -> Iterator[Worker]:
        for pool in self.pools.values():
            yield from list(pool.workers.values())

    def find(self, url: str) -> Worker | None:
        for pool in self.pools.values():
            if url in pool.workers:
                return pool.workers[url]
        return None

    def add(self, url: str, role: str) -> tuple[Worker, bool]:
        """Add a worker to the pool of its role; (worker, created)."""
        url = normalize_url(url)
        if role not in POOLS:
            raise ValueError(f"role must be one of {', '.join(POOLS)}")
        old = self.find(url)
        if old is not None and old.role == role:
            return old, False
        if old is not None:
            self.pools[old.role].remove(url)
        return self.pools[role].add(url), True

    def remove(self, url: str) -> Worker | None:
        url = normalize_url(url)
        w = self.find(url)
        return self.pools[w.role].remove(url) if w else None

    def route(self) -> str:
        """'pd' when a prefill and a decode worker are healthy, else 'both', else 503."""
        if self.prefill.healthy and self.decode.healthy:
            return "pd"
        if self.both.healthy:
            return "both"
        if self.prefill.workers or self.decode.workers:
            empty = "prefill" if not self.prefill.healthy else "decode"
            message = f"no healthy {empty} worker"
        else:
            message = "no healthy worker"
        raise APIError(
            503, message, "service_unavailable", "no_healthy_worker", headers={"Retry-After": "1"}
        )

    def snapshot(self) -> dict[str, Any]:
        return {
            name: {
                "policy": pool.policy.name,
                "healthy": len(pool.healthy),
                "workers": [w.to_dict() for w in pool.workers.values()],
            }
            for name, pool in self.pools.items()
        }
