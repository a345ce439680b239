"""`SimulatedRunner`: the engine's model runner on a simulated device (`pd-worker --simulate`).

A drop-in for `pd/worker/model/runner.py`'s ModelRunner as the engine, the PD roles and the
transfer role read it, with no weights and no KV tensors: `execute(batch)` computes nothing, asks
the cost model how long the step takes on the profile's device (`CostModel.step` over the
batch's `(num_cached, num_new)` rows), sleeps on the engine's executor thread until the step's
start plus `time_scale` times that, and answers deterministic tokens (tokens.py). The page
accounting around it (scheduler, KV cache manager, prefix cache, roles) is the real one; the
KV pool it describes to the transfer layer has the profile's real page sizes at addresses that
hold nothing (`kv_pool_desc`), so the simulated transfer moves no byte either.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from pd.sim.clock import OVERSHOOT_WINDOW, ClockStats, StepClock
from pd.sim.cost import CostModel
from pd.sim.profile import ModelSpec, Profile
from pd.transfer.pools import PoolDesc, RankRegion, TpSplit
from pd.worker.model.config import ModelConfig
from pd.worker.model.prompt_logprobs import PromptLogprob
from pd.worker.model.runner import StepBatch, StepRequest
from pd.worker.model.sampler import SampleOutput
from pd.worker.simulated.tokens import CHOSEN_LOGPROB, TokenPicker, prompt_key
from pd.worker.text.tokenizer import Tokenizer

ATTENTION_BACKEND = "simulated"
ROPE_THETA = 500000.0  # nominal (nothing rotates): Llama 3's
RMS_NORM_EPS = 1e-5


def model_config(spec: ModelSpec, vocab_size: int, max_model_len: int) -> ModelConfig:
    """The profile model's shape as pd's ModelConfig, with the vocabulary of the tokenizer the
    text comes from (token masks and id checks cover that one; the cost model keeps the
    profile's vocabulary for the LM head)."""
    return ModelConfig(
        name=spec.name,
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rope_theta=ROPE_THETA,
        rms_norm_eps=RMS_NORM_EPS,
        max_position_embeddings=max_model_len,
        tie_word_embeddings=False,
    )


def sim_digest(spec: ModelSpec) -> str:
    """The checkpoint digest of a simulated model: its spec, so P and D of one model pair (on any
    device or TP) and workers of two models do not."""
    return "sim:" + hashlib.sha256(repr(sorted(asdict(spec).items())).encode()).hexdigest()[:32]


class _FakeAddresses:
    """Base addresses that hold nothing, never overlapping within a process (several simulated
    workers may share one: pd/worker/simulated/host.py)."""

    ALIGN = 1 << 30

    def __init__(self) -> None:
        self._next = 1 << 44
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> int:
        with self._lock:
            base = self._next
            self._next += -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN + self.ALIGN
            return base


_ADDRESSES = _FakeAddresses()


class SimulatedRunner:
    def __init__(
        self,
        profile: Profile,
        tokenizer: Tokenizer,
        *,
        page_size: int,
        num_pages: int,
        max_model_len: int,
        time_scale: float = 1.0,
        window: int = OVERSHOOT_WINDOW,
    ) -> None:
        self.profile = profile
        self.cost = CostModel(profile)
        self.config = model_config(profile.model, tokenizer.vocab_size, max_model_len)
        self.dtype = torch.bfloat16  # nominal: what the KV contract names (no tensor is made)
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.tp = profile.tp
        self.quantization = "none"
        self.attention_backend = ATTENTION_BACKEND
        self.checkpoint_digest = sim_digest(profile.model)
        self.picker = TokenPicker(tokenizer, self.config.vocab_size)
        self.clock = StepClock(time_scale, window)
        self._keys: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._pool: PoolDesc | None = None

    # -- the engine's step ----------------------------------------------------------------

    def execute(self, batch: StepBatch) -> SampleOutput:
        """One step: its tokens at once, then a sleep until its modeled time (scaled) is up."""
        start = self.clock.now()
        sampled = [s for s, flag in zip(batch.seqs, batch.sample) if flag]
        sampled += [child for _, child in batch.riders]
        out = SampleOutput(token_ids=[], logprobs=[], top_logprobs=[])
        for seq in sampled:
            mask = self._mask(seq)
            t = self.picker.token(self._key(seq), len(seq.output_ids), mask)
            out.token_ids.append(t)
            wants = seq.params.wants_logprobs
            out.logprobs.append(CHOSEN_LOGPROB if wants else None)
            out.top_logprobs.append(
                self.picker.alternatives(t, seq.params.top_logprobs) if wants else None
            )
        head_rows = len(sampled)
        for i, seq in enumerate(batch.seqs):
            if seq.params.prompt_logprobs is not None:
                entries = self._prompt_logprobs(seq, batch.num_cached[i], batch.num_new[i])
                if entries:
                    out.prompt_logprobs.append((i, batch.num_cached[i], entries))
                    head_rows += len(entries)  # the LM head computes those rows too
        rows = list(zip(batch.num_cached, batch.num_new))
        self.clock.finish(start, self.cost.step(rows, head_rows).total_s)
        return out

    def _key(self, seq: StepRequest) -> int:
        """The request's prompt key, computed once per request (its prompt never changes)."""
        try:
            key = self._keys.get(seq)
        except TypeError:  # not weakly referenceable (a stand-in): computed each time
            return prompt_key(seq.prompt_ids, seq.params.seed)
        if key is None:
            key = self._keys[seq] = prompt_key(seq.prompt_ids, seq.params.seed)
        return key

    def _mask(self, seq: StepRequest) -> np.ndarray | None:
        if seq.rules is None:
            return None
        words = (self.config.vocab_size + 31) // 32
        row = np.full(words, -1, dtype=np.int32)  # all allowed
        seq.rules.fill_mask(row, seq.output_ids)
        return row

    def _prompt_logprobs(self, seq: StepRequest, cached: int, new: int) -> list[PromptLogprob]:
        """Fixed logprobs at the prompt positions of this chunk that predict a prompt token."""
        k = seq.params.prompt_logprobs
        assert k is not None
        end = min(cached + new, len(seq.prompt_ids) - 1)
        targets = seq.prompt_ids[cached + 1 : end + 1]
        return [(CHOSEN_LOGPROB, 1, self.picker.alternatives(t, k)) for t in targets]

    def step_seconds(self, wall_s: float) -> float:
        """The step the engine just timed at `wall_s`: its device time, as the clock kept it
        (a GPU's step does not include this host's late wake-ups)."""
        return self.clock.last_step_s

    def stats(self) -> ClockStats:
        return self.clock.stats()

    def describe(self) -> dict[str, Any]:
        """The `simulate` object of /health: the profile, the time scale, the clock's figures."""
        return {"profile": self.profile.name, **self.stats().to_dict()}

    # -- what the transfer layer registers ------------------------------------------------

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one KV page on one TP rank: layers x K/V x its KV heads x page x head dim."""
        return self._split().slot_bytes

    def _heads_per_rank(self) -> int:
        # More ranks than KV heads replicate heads over consecutive ranks (as ModelRunner's).
        return max(1, self.config.num_kv_heads // self.tp)

    def _split(self) -> TpSplit:
        m = self.profile.model
        return TpSplit(
            m.num_layers * 2,
            self._heads_per_rank(),
            self.page_size * m.head_dim * m.dtype_bytes,
            m.num_kv_heads,
        )

    def kv_pool_desc(self, name: str) -> PoolDesc:
        """The KV pool as the transfer layer sees it: `num_pages` slots of the profile's page
        bytes per rank, one region per TP rank (cuda:r, so each rank has a link of its own in
        the simulated transfer), at addresses that hold nothing. The same each call."""
        if self._pool is None or self._pool.name != name:
            split = self._split()
            heads, tp = split.heads, self.tp
            group = heads * tp // split.total_heads  # ranks holding the same heads
            bases = [_ADDRESSES.take(self.num_pages * split.slot_bytes) for _ in range(tp)]
            ranks = tuple(
                RankRegion(base, f"cuda:{r}", (r // group) * heads) for r, base in enumerate(bases)
            )
            self._pool = PoolDesc(
                name, self.num_pages, split.slot_bytes, ranks, split=split, meta={"sim": True}
            )
        return self._pool
