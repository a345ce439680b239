"""Prometheus metrics of one worker, in a registry of its own (several workers may share a process
in tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pd.protocol import WorkerLoad
from pd.sim.clock import ClockStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._load: Callable[[], WorkerLoad] | None = None
        self.prompt_tokens = Counter(
            "pd_prompt_tokens", "prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("pd_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter(
            "pd_requests", "finished requests by finish reason", ["reason"], registry=r
        )
        self.aborted = Counter(
            "pd_requests_aborted", "requests aborted by their client", registry=r
        )
        self.preemptions = Counter("pd_preemptions", "requests preempted for pages", registry=r)
        self.internal_refusals = Counter(
            "pd_internal_field_refusals",
            "kv_transfer_params or pd_continuation refused (403): unsigned from another host, or "
            "not signed with this worker's cluster token (pd/signing.py)",
            ["field"],
            registry=r,
        )
        self.ttft = Histogram(
            "pd_time_to_first_token_seconds",
            "time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pd_inter_token_latency_seconds",
            "time between output tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_pull = Histogram(
            "pd_kv_transfer_seconds",
            "decode: KV pulls from their start (pages reserved, reads posted) to success",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_pull_bytes = Counter(
            "pd_kv_transfer_bytes", "decode: KV bytes pulled by successful pulls", registry=r
        )
        self.kv_pulls_failed = Counter(
            "pd_kv_transfers_failed", "decode: pulls that failed, and why", ["reason"], registry=r
        )
        self.e2e = Histogram(
            "pd_request_latency_seconds",
            "request latency, arrival to finish",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        gauges: dict[str, tuple[str, Callable[[WorkerLoad], int]]] = {
            "pd_kv_pages_total": ("KV pages per rank", lambda w: w.kv_pages_total),
            "pd_kv_pages_free": ("free KV pages per rank", lambda w: w.kv_pages_free),
            "pd_requests_running": ("requests in the running batch", lambda w: w.running),
            "pd_requests_waiting": ("requests waiting for admission", lambda w: w.waiting),
            "pd_kv_transfers_inflight": (
                "requests whose pages are held for a KV transfer (P: pinned; D: pulling)",
                lambda w: w.inflight_transfers,
            ),
            "pd_kv_pages_held": (
                "KV pages held for transfers (P: pinned for D; D: reserved for the pull)",
                lambda w: w.kv_pages_held,
            ),
            "pd_kv_pages_pinned": (
                "prefill: KV pages pinned for decode workers to pull",
                lambda w: w.kv_pages_pinned,
            ),
            "pd_kv_pages_reserved": (
                "decode: KV pages reserved for pulls (transferring, or quarantined)",
                lambda w: w.kv_pages_reserved,
            ),
            "pd_kv_pulls_waiting_for_pages": (
                "decode: pulled requests queued until their KV pages fit",
                lambda w: w.waiting_for_pages,
            ),
            "pd_queued_prefill_tokens": (
                "prompt tokens not yet prefilled",
                lambda w: w.queued_prefill_tokens,
            ),
            "pd_kv_pages_cached": (
                "KV pages the prefix cache can match (held or not)",
                lambda w: w.kv_pages_cached,
            ),
            "pd_kv_pages_evictable": (
                "cached KV pages no request holds (counted as free)",
                lambda w: w.kv_pages_evictable,
            ),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(partial(self._read, read))
        self._cache_stats: Callable[[], tuple[int, int]] = lambda: (0, 0)
        r.register(_PrefixCacheCollector(lambda: self._cache_stats()))

    def read_simulation_from(self, stats: Callable[[], ClockStats]) -> None:
        """--simulate: export the simulated clock's figures (`stats()`, read at scrape time)."""
        self.registry.register(_SimulationCollector(stats))

    def read_cache_stats_from(self, stats: Callable[[], tuple[int, int]]) -> None:
        """`stats()` gives (prompt tokens looked up, prompt tokens found) in the prefix cache."""
        self._cache_stats = stats

    def read_peers_lost_from(self, lost: Callable[[], int]) -> None:
        """pd_kv_peers_lost_total: the transfer manager's lost peer links, read at scrape."""
        self.registry.register(_PeersLostCollector(lost))

    def serve_model_server_names(self, model_name: str) -> None:
        """Also export the model-server protocol's names (vLLM's `vllm:*`, with its `model_name`
        label), which GIE endpoint pickers, KEDA scalers and existing dashboards read."""
        self.registry.register(_ModelServerCollector(model_name, self._current_load))

    def _current_load(self) -> WorkerLoad | None:
        return self._load() if self._load is not None else None

    def read_load_from(self, load: Callable[[], WorkerLoad]) -> None:
        """The gauges read `load()` (the engine's current `WorkerLoad`) at scrape time."""
        self._load = load

    def _read(self, field: Callable[[WorkerLoad], int]) -> float:
        return float(field(self._load())) if self._load is not None else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ModelServerCollector(Collector):
    """vllm:num_requests_waiting / _running, vllm:kv_cache_usage_perc (a 0-1 fraction, as vLLM
    exports it) and vllm:cache_config_info (1, the KV geometry in its labels), read at scrape
    time from the same load as pd_*."""

    def __init__(self, model_name: str, load: Callable[[], WorkerLoad | None]) -> None:
        self._model = model_name
        self._load = load

    def collect(self) -> Iterator[GaugeMetricFamily]:
        w = self._load()
        if w is None:
            return
        for name, doc, value in (
            ("vllm:num_requests_waiting", "requests waiting for admission", w.waiting),
            ("vllm:num_requests_running", "requests in the running batch", w.running),
            ("vllm:kv_cache_usage_perc", "KV cache in use, a fraction (1: full)", w.kv_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], value)
            yield g
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "the KV cache's geometry (labels); always 1",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        info.add_metric([self._model, str(w.kv_page_size), str(w.kv_pages_total)], 1.0)
        yield info


class _PrefixCacheCollector(Collector):
    """pd_prefix_cache_queries_total / _hits_total, in prompt tokens, read at scrape time."""

    def __init__(self, stats: Callable[[], tuple[int, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        queries, hits = self._stats()
        yield CounterMetricFamily(
            "pd_prefix_cache_queries", "prompt tokens looked up in the prefix cache", queries
        )
        yield CounterMetricFamily(
            "pd_prefix_cache_hits", "prompt tokens found in the prefix cache", hits
        )


class _PeersLostCollector(Collector):
    def __init__(self, lost: Callable[[], int]) -> None:
        self._lost = lost

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "pd_kv_peers_lost",
            "decode: links to prefill peers lost (dead, silent or restarted); their transfers "
            "failed, the next request dials again",
            self._lost(),
        )


class _SimulationCollector(Collector):
    """A simulated worker's clock (pd/sim/clock.py): steps, modeled and real seconds, and how far
    real steps overshot their scaled modeled time (quantiles over the latest steps)."""

    def __init__(self, stats: Callable[[], ClockStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats()
        yield CounterMetricFamily("pd_sim_steps", "simulated steps run", s.steps)
        yield CounterMetricFamily(
            "pd_sim_modeled_seconds",
            "the cost model's seconds of those steps (unscaled)",
            s.modeled_s,
        )
        yield CounterMetricFamily(
            "pd_sim_real_seconds", "the seconds those steps really took", s.real_s
        )
        yield GaugeMetricFamily(
            "pd_sim_time_scale",
            "--time-scale: every modeled duration is stretched by it",
            s.time_scale,
        )
        overshoot = GaugeMetricFamily(
            "pd_sim_step_overshoot_seconds",
            "real minus scaled modeled duration of a step, over the latest steps (quantile 1: max)",
            labels=["quantile"],
        )
        for q, v in (
            ("0.5", s.overshoot_p50_s),
            ("0.99", s.overshoot_p99_s),
            ("1", s.overshoot_max_s),
        ):
            overshoot.add_metric([q], v)
        yield overshoot
        gap = GaugeMetricFamily(
            "pd_sim_host_gap_seconds",
            "the engine's own time between back-to-back steps (not modeled), over the latest steps",
            labels=["quantile"],
        )
        for q, v in (("0.5", s.host_gap_p50_s), ("0.99", s.host_gap_p99_s)):
            gap.add_metric([q], v)
        yield gap
