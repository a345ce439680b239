"""Router configuration: one frozen dataclass, validated once; CLI flags take defaults from it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pd.cli_args import add_dataclass_arguments, dataclass_from_args
from pd.cli_args import flag as _flag
from pd.cors import ORIGINS_HELP, check_origins
from pd.registration import normalize_url
from pd.router.admission import CLASSES, DEFAULT_LIMITS, ClassLimits
from pd.tracing import OTLP_ENDPOINT_HELP, OTLP_SAMPLE_RATIO_HELP, otlp_flags_error

POLICIES = ("round-robin", "load-aware", "sticky-to-room", "cache-aware")
POOLS = ("prefill", "decode", "both")
DISCOVERY = ("static", "file", "kubernetes")


@dataclass(frozen=True)
class RouterConfig:
    host: str = _flag("127.0.0.1", "address to listen on")
    port: int = _flag(8000, "HTTP port (0 picks a free one)")
    prefill: tuple[str, ...] = _flag((), "URL of a prefill worker (repeatable)", repeat=True)
    decode: tuple[str, ...] = _flag((), "URL of a decode worker (repeatable)", repeat=True)
    worker: tuple[str, ...] = _flag(
        (), "URL of a co-located (--role both) worker (repeatable)", repeat=True
    )
    discovery: str = _flag(
        "static", "where workers come from: static (the flags above, and workers that register "
        "themselves), file (--discovery-file, watched) or kubernetes (EndpointSlices by "
        "--k8s-*-selector, watched); the flags and registrations still add",
        choices=DISCOVERY,
    )  # fmt: skip
    discovery_file: str | None = _flag(
        None, "--discovery file: a file of 'ROLE URL' lines (docs/deploy.md), read when it changes"
    )
    discovery_interval_s: float = _flag(1.0, "seconds between looks at the discovery file")
    k8s_api: str | None = _flag(
        None, "--discovery kubernetes: the API server's URL (default: the pod's, with its "
        "service account's token and CA)",
    )  # fmt: skip
    k8s_namespace: str | None = _flag(None, "the workers' namespace (default: the pod's)")
    k8s_prefill_selector: str | None = _flag(
        None, "label selector of the prefill workers' EndpointSlices (e.g. "
        "kubernetes.io/service-name=pd-prefill)",
    )  # fmt: skip
    k8s_decode_selector: str | None = _flag(
        None, "label selector of the decode workers' EndpointSlices"
    )
    k8s_worker_selector: str | None = _flag(
        None, "label selector of the co-located workers' EndpointSlices"
    )
    k8s_port_name: str = _flag("http", "the EndpointSlice port the workers serve HTTP on")
    endpoint_picker: bool = _flag(
        False, "also serve the Gateway API Inference Extension's endpoint picker (Envoy "
        "ext_proc, gRPC; docs/deploy.md): the decode worker picked for each request, with pd's "
        "policies (needs pip install 'pd[k8s]')", store_true=True,
    )  # fmt: skip
    picker_port: int = _flag(9002, "--endpoint-picker: its gRPC port (0 picks a free one)")
    picker_shed: bool = _flag(
        False, "--endpoint-picker: answer 429 while every decode worker is busy (none ready) "
        "rather than queue on the least loaded", store_true=True,
    )  # fmt: skip
    policy: str = _flag("load-aware", "routing policy of every pool", choices=POLICIES)
    prefill_policy: str | None = _flag(
        None, "policy of the prefill pool (default: --policy)", choices=POLICIES
    )
    decode_policy: str | None = _flag(
        None, "policy of the decode pool (default: --policy)", choices=POLICIES
    )
    api_key: str | None = _flag(
        None, "require 'Authorization: Bearer KEY' on /v1/*", env="PD_ROUTER_API_KEY"
    )
    admin_token: str | None = _flag(
        None,
        "bearer token of the worker admin API (/workers); without it the API is read-only",
        env="PD_ROUTER_ADMIN_TOKEN",
    )
    worker_api_key: str | None = _flag(
        None, "bearer key sent to workers started with --api-key", env="PD_WORKER_API_KEY"
    )
    cluster_token: str | None = _flag(
        None,
        "shared secret of the router and its workers: signs the continuations of migrated "
        "streams (pd_continuation; without it workers take them from loopback only)",
        env="PD_CLUSTER_TOKEN",
    )
    health_interval: float = _flag(2.0, "seconds between health checks of each worker")
    health_timeout: float = _flag(1.0, "seconds a health check may take")
    health_failures: int = _flag(2, "consecutive failed checks that eject a worker")
    health_successes: int = _flag(1, "consecutive good checks that re-admit an ejected worker")
    connect_timeout: float = _flag(3.0, "seconds to connect to a worker")
    prefill_timeout: float = _flag(
        300.0, "most seconds a prefill request may take (caps the deadline below)"
    )
    prefill_deadline_base: float = _flag(
        10.0, "seconds a prefill may take beyond what its tokens account for"
    )
    prefill_min_rate: float = _flag(
        200.0,
        "prompt tokens per second a prefill worker sustains at the least: a prefill's deadline "
        "is --prefill-deadline-base plus the tokens in flight on that worker over this rate",
    )
    read_timeout: float = _flag(
        120.0,
        "longest wait (seconds) for a decode or co-located worker's first byte (then retried "
        "elsewhere); between chunks see --stream-idle-timeout-s",
    )
    stream_idle_timeout_s: float = _flag(
        75.0,
        "longest silence (seconds) of a decode or co-located worker between stream chunks: "
        "then the stream is continued on another worker (migrated). Workers send a keep-alive "
        "comment after 5 s of silence; the default exceeds a worker's page wait plus pull "
        "(30 + 30 s)",
    )
    migration_limit: int = _flag(
        3,
        "most migrations of each choice of a request: a stream that breaks (connection, EOF before [DONE], "
        "ejection, silence, drain) is continued on another worker, at most this many times, "
        "then it ends with an error event",
    )
    max_retries: int = _flag(
        2, "retries on other workers per phase, only before the client got a byte"
    )
    max_body_bytes: int = _flag(8 << 20, "largest request body accepted (413 beyond)")
    max_prompt_bytes: int = _flag(
        1 << 20,
        "largest prompt accepted, in bytes of its canonical form (text as UTF-8, chat messages "
        "as role, content and two separators each, 4 bytes a token id; 400 prompt_too_large "
        "beyond). 1 MiB, well under --max-body-bytes: about 250,000 tokens, beyond the context "
        "of the models served, and small enough that hashing it for the prefix index stays "
        "cheap on the router's one event loop",
    )
    sticky_load_factor: float = _flag(
        1.25, "sticky-to-room: no worker takes more than this times the mean in-flight, plus one"
    )
    sticky_slack: int = _flag(
        4, "sticky-to-room: in-flight requests a worker may hold beyond the load factor's share"
    )
    sticky_room_ttl_s: float = _flag(
        3600.0, "sticky-to-room: how long a room keeps its worker after its last request"
    )
    sticky_room_table_bytes: int = _flag(
        24 << 20,
        "sticky-to-room: most bytes of the room -> worker table, per pool (room keys are kept "
        "as 16-byte hashes, about 240 bytes a room: the default holds ~100,000 rooms; the least "
        "recently used go first)",
    )
    cache_balance_abs: int = _flag(
        64,
        "cache-aware: the pool is imbalanced when its busiest and idlest workers' in-flight "
        "counts differ by more than this and by --cache-balance-rel times",
    )
    cache_balance_rel: float = _flag(1.5, "cache-aware: see --cache-balance-abs")
    cache_threshold: float = _flag(
        0.3, "cache-aware: least share of the prompt a worker must be expected to hold"
    )
    prefix_index_blocks: int = _flag(
        1 << 16,
        "most prompt blocks (64 bytes of prompt each) the router remembers per worker; each "
        "costs the router about 180 bytes (a hash in an LRU), so the default keeps at most "
        "~12 MiB per worker; 0 turns the index off (cache-aware then acts as load-aware)",
    )
    prefix_index_answer_bytes: int = _flag(
        1 << 20,
        "most bytes of a relayed chat stream the router keeps, per stream in flight, to read "
        "its answer back for the prefix index (1 MiB: about 8,000 tokens of SSE); a longer "
        "stream is not kept, and only its prompt is learnt",
    )
    max_answer_bytes: int = _flag(
        32 << 20,
        "most bytes of a non-streamed answer, which the router assembles from the worker's "
        "stream and holds whole (~6 times this in memory): a request expected to exceed it is "
        "a 400 before any work, an answer that grows past it a 400 (its worker's request "
        "aborted); streamed answers are relayed and never held",
    )
    prefix_index_ttl_s: float = _flag(1800.0, "how long the index remembers a block it sent")
    local_prefill_max_tokens: int = _flag(
        256,
        "decode-local prefill: a request whose decode worker is expected to lack at most this "
        "many prompt tokens (estimated) skips the prefill worker; 0 turns it off",
    )
    ignore_unknown_fields: bool = _flag(
        False,
        "accept request fields pd does not know (logged once per name, and not passed on to "
        "the workers), as vLLM does; by default they are a 400, as OpenAI answers them",
        store_true=True,
    )
    allowed_origins: tuple[str, ...] = _flag((), ORIGINS_HELP, repeat=True, metavar="ORIGIN")
    access_log: bool = _flag(False, "log every request (costs latency)", store_true=True)
    log_level: str = _flag("info", "logging level", choices=("debug", "info", "warning", "error"))
    otlp_endpoint: str | None = _flag(None, OTLP_ENDPOINT_HELP)
    otlp_sample_ratio: float = _flag(1.0, OTLP_SAMPLE_RATIO_HELP)
    max_concurrency: int = _flag(
        0, "requests served at once (a slot each); beyond, they wait by priority class "
        "(docs/api.md); 0: no budget, every request admitted",
    )  # fmt: skip
    class_reserved: str = _flag(
        "system=1", "slots of --max-concurrency that only a class takes: CLASS=N,... (classes "
        "system, interactive, default, batch)",
    )  # fmt: skip
    class_queue: str = _flag(
        "system=64,interactive=64,default=128,batch=512",
        "requests that may wait for a slot, per class (429 beyond): CLASS=N,...",
    )
    class_deadline_s: str = _flag(
        "system=30,interactive=10,default=30,batch=300",
        "the longest wait for a slot, per class, in seconds (408 beyond): CLASS=S,...",
    )
    no_priority: bool = _flag(
        False, "no priority classes: one first-come-first-served queue, no reserved slots, no "
        "preemption", store_true=True,
    )  # fmt: skip

    @property
    def class_limits(self) -> dict[str, ClassLimits]:
        """--class-reserved, --class-queue and --class-deadline-s, per class."""
        reserved = _per_class(self.class_reserved, "--class-reserved", int)
        queue = _per_class(self.class_queue, "--class-queue", int)
        deadline = _per_class(self.class_deadline_s, "--class-deadline-s", float)
        out = {}
        for c in CLASSES:
            base = DEFAULT_LIMITS[c]
            out[c] = ClassLimits(
                reserved=int(reserved.get(c, 0)),
                queue=int(queue.get(c, base.queue)),
                deadline_s=float(deadline.get(c, base.deadline_s)),
            )
        return out

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        for name in ("prefill", "decode", "worker"):
            urls = tuple(normalize_url(u) for u in getattr(self, name))
            object.__setattr__(self, name, urls)
        all_urls = self.prefill + self.decode + self.worker
        check(len(set(all_urls)) == len(all_urls), "a worker URL is given more than once")
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            check(
                value is None or value in POLICIES,
                f"--{name.replace('_', '-')} must be one of {', '.join(POLICIES)}",
            )
        check(0 <= self.port < 65536, "--port must be in 0..65535")
        check(self.discovery in DISCOVERY, f"--discovery must be one of {', '.join(DISCOVERY)}")
        check(
            (self.discovery == "file") == (self.discovery_file is not None),
            "--discovery file and --discovery-file PATH go together",
        )
        check(self.discovery_interval_s > 0, "--discovery-interval-s must be > 0")
        check(
            self.discovery != "kubernetes" or bool(self.k8s_selectors),
            "--discovery kubernetes needs a --k8s-prefill-selector, --k8s-decode-selector or "
            "--k8s-worker-selector",
        )
        check(0 <= self.picker_port < 65536, "--picker-port must be in 0..65535")
        check(self.health_interval > 0, "--health-interval must be > 0")
        check(self.health_timeout > 0, "--health-timeout must be > 0")
        check(self.health_failures >= 1, "--health-failures must be >= 1")
        check(self.health_successes >= 1, "--health-successes must be >= 1")
        check(self.connect_timeout > 0, "--connect-timeout must be > 0")
        check(self.prefill_timeout > 0, "--prefill-timeout must be > 0")
        check(self.prefill_deadline_base > 0, "--prefill-deadline-base must be > 0")
        check(self.prefill_min_rate > 0, "--prefill-min-rate must be > 0")
        check(self.read_timeout > 0, "--read-timeout must be > 0")
        check(self.stream_idle_timeout_s > 0, "--stream-idle-timeout-s must be > 0")
        check(self.migration_limit >= 0, "--migration-limit must be >= 0")
        check(self.max_retries >= 0, "--max-retries must be >= 0")
        check(self.max_body_bytes >= 1024, "--max-body-bytes must be >= 1024")
        check(self.max_prompt_bytes >= 1, "--max-prompt-bytes must be >= 1")
        check(self.sticky_load_factor >= 1.0, "--sticky-load-factor must be >= 1.0")
        check(self.sticky_room_ttl_s > 0, "--sticky-room-ttl-s must be > 0")
        check(self.sticky_slack >= 1, "--sticky-slack must be >= 1")
        check(self.cache_balance_abs >= 0, "--cache-balance-abs must be >= 0")
        check(self.cache_balance_rel >= 1.0, "--cache-balance-rel must be >= 1.0")
        check(0.0 <= self.cache_threshold <= 1.0, "--cache-threshold must be in [0, 1]")
        check(self.prefix_index_blocks >= 0, "--prefix-index-blocks must be >= 0")
        check(self.prefix_index_ttl_s > 0, "--prefix-index-ttl-s must be > 0")
        check(self.prefix_index_answer_bytes >= 0, "--prefix-index-answer-bytes must be >= 0")
        check(self.max_answer_bytes >= 4096, "--max-answer-bytes must be >= 4096")
        check(self.sticky_room_table_bytes >= 1024, "--sticky-room-table-bytes must be >= 1024")
        check(self.local_prefill_max_tokens >= 0, "--local-prefill-max-tokens must be >= 0")
        check_origins(self.allowed_origins)
        why = otlp_flags_error(self.otlp_endpoint, self.otlp_sample_ratio)
        check(not why, why)
        check(self.max_concurrency >= 0, "--max-concurrency must be >= 0")
        limits = self.class_limits  # raises ValueError on a malformed spec
        check(
            all(v.reserved >= 0 and v.queue >= 0 and v.deadline_s > 0 for v in limits.values()),
            "--class-reserved and --class-queue must be >= 0, --class-deadline-s > 0",
        )
        check(
            not self.max_concurrency
            or sum(v.reserved for v in limits.values()) <= self.max_concurrency,
            "--class-reserved holds more slots than --max-concurrency",
        )
        for name in ("api_key", "admin_token", "worker_api_key", "cluster_token"):
            check(getattr(self, name) != "", f"--{name.replace('_', '-')} must not be empty")

    @property
    def k8s_selectors(self) -> dict[str, str]:
        """{pool: label selector} of --discovery kubernetes."""
        given = {
            "prefill": self.k8s_prefill_selector,
            "decode": self.k8s_decode_selector,
            "both": self.k8s_worker_selector,
        }
        return {pool: sel for pool, sel in given.items() if sel}

    def policy_of(self, pool: str) -> str:
        """The policy name of a pool: 'prefill', 'decode' or 'both'."""
        if pool == "prefill" and self.prefill_policy:
            return self.prefill_policy
        if pool == "decode" and self.decode_policy:
            return self.decode_policy
        return self.policy

    # ------------------------------------------------------------------------------ CLI

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_arguments(parser, cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        return dataclass_from_args(cls, args)


def _per_class(spec: str, flag: str, kind: type[int] | type[float]) -> dict[str, float]:
    """`CLASS=VALUE,...` as {class: value}; ValueError naming `flag` when malformed."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        cls, eq, value = part.partition("=")
        cls = cls.strip()
        if not eq or cls not in CLASSES:
            raise ValueError(f"{flag} {spec!r}: each entry is CLASS=VALUE, CLASS one of "
                             f"{', '.join(CLASSES)}")  # fmt: skip
        try:
            out[cls] = kind(value)
        except ValueError:
            raise ValueError(f"{flag} {spec!r}: {value!r} is not a number") from None
    return out
