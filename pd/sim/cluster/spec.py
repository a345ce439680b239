"""What a simulated cluster is: its pools of workers (P and D, or co-located), each worker's
profile at its pool's TP, the scheduler's limits every worker shares, and the router's policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd.sim.profile import Profile, with_tp

ROLES = ("prefill", "decode", "both")
POLICIES = ("least-loaded", "round-robin")


@dataclass(frozen=True)
class Limits:
    """The scheduler's limits of every simulated worker (pd-worker's flags of the same names)."""

    chunk_size: int = 8192  # --chunk-size: the token budget of one step (prefill + decode)
    max_running: int = 256  # --max-running-requests
    page_size: int = 16  # --page-size: tokens per KV page
    prefix_cache: bool = True  # --prefix-cache (on prefill and co-located workers)

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.page_size < 1:
            raise ValueError("max_running and page_size must be >= 1")
        # NOTE: every running decode row is then in every step, which lets the DES step a
        # decode batch in time independent of its size (des.py).
        if self.chunk_size <= self.max_running:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) must exceed max_running ({self.max_running})"
            )


@dataclass(frozen=True)
class Pool:
    role: str
    workers: int
    tp: int

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}: one of {', '.join(ROLES)}")
        if self.workers < 1 or self.tp < 1:
            raise ValueError("a pool has >= 1 worker of tp >= 1")

    @property
    def gpus(self) -> int:
        return self.workers * self.tp


@dataclass(frozen=True)
class ClusterSpec:
    """P and D pools (in that order), or one pool of co-located workers."""

    profile: Profile  # model, device and link; each pool's TP replaces the profile's
    pools: tuple[Pool, ...]
    limits: Limits = field(default_factory=Limits)
    policy: str = "least-loaded"

    def __post_init__(self) -> None:
        roles = tuple(p.role for p in self.pools)
        if roles not in (("prefill", "decode"), ("both",)):
            raise ValueError(f"pools are (prefill, decode) or (both,), got {roles}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}: one of {', '.join(POLICIES)}")

    @classmethod
    def disaggregated(
        cls, profile: Profile, prefill: int, prefill_tp: int, decode: int, decode_tp: int,
        limits: Limits | None = None, policy: str = "least-loaded",
    ) -> ClusterSpec:  # fmt: skip
        pools = (Pool("prefill", prefill, prefill_tp), Pool("decode", decode, decode_tp))
        return cls(profile, pools, limits or Limits(), policy)

    @classmethod
    def colocated(
        cls, profile: Profile, workers: int, tp: int, limits: Limits | None = None,
        policy: str = "least-loaded",
    ) -> ClusterSpec:  # fmt: skip
        return cls(profile, (Pool("both", workers, tp),), limits or Limits(), policy)

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    @property
    def is_disaggregated(self) -> bool:
        return self.pools[0].role == "prefill"

    def pool_profile(self, pool: Pool) -> Profile:
        return with_tp(self.profile, pool.tp)

    @property
    def name(self) -> str:
        """`2P x tp4 + 2D x tp4`, or `4 x tp4 co-located`."""
        if not self.is_disaggregated:
            p = self.pools[0]
            return f"{p.workers} x tp{p.tp} co-located"
        p, d = self.pools
        return f"{p.workers}P x tp{p.tp} + {d.workers}D x tp{d.tp}"
