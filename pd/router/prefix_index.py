"""What the router expects each worker to have cached: an approximate prefix index per worker.

The router does not tokenize. It serializes a request's prompt canonically (`prompt_bytes`: the
chat messages as `role\\n content \\0` each, or the completion prompt), cuts the bytes into
blocks of `BLOCK_BYTES` and chains their hashes (`chain`), so two prompts share the first k
hashes exactly when they share the first k blocks. A request's `cache_salt` seeds its chain
(`salt_seed`): prompts under different salts share no block, so no tenant's routing
(cache-aware, decode-local) can tell what another salt's prompts were. Per worker, the index
keeps the hashes it has sent there (prompts, and for workers that decode also the answers, which
their caches hold too), with an LRU bound and a TTL: `match` counts how many leading blocks of a
prompt a worker should still hold, and only answers that ended well, from a worker still healthy
in its pool, are recorded.

Tokens are estimates: bytes divided by a bytes-per-token ratio (`TokenEstimate`) that starts at
4 and is calibrated from the prompt tokens the prefill workers report in their answers' usage.
The estimate is approximate by design: a wrong guess costs time (a worker computes what it lacks),
never correctness.

Each worker's LRU is bounded by the smaller of `max_blocks` and what its KV cache can hold (the
pages and page size it reports, in blocks at the current ratio), so the router forgets roughly as
the worker evicts. A worker's entries are dropped when it restarts (a new `instance` in its
/health), is ejected, or leaves the pool. Memory: a block costs the router about
`INDEX_BLOCK_BYTES` (a hash and a time in an OrderedDict), whatever the client sent; no prompt
bytes are kept past the request.
"""

from __future__ import annotations

import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pd.protocol import ChatCompletionRequest, CompletionRequest

BLOCK_BYTES = 64  # about 16 tokens of English text: the workers' page size, roughly
INITIAL_BYTES_PER_TOKEN = 4.0
# What one block costs in a worker's LRU (its hash, the OrderedDict's entry; the time is shared
# by a chain's blocks), as tracemalloc showed it at --prefix-index-blocks' default
# (docs/EXPERIMENTS.md §23). That flag's help gives the total.
INDEX_BLOCK_BYTES = 180


def prompt_bytes(req: CompletionRequest | ChatCompletionRequest) -> bytes:
    """The prompt of a parsed request, canonically serialized: the serialization of a
    conversation is a prefix of the serialization of that conversation continued.

    It reads what `parse_request` made of the body (a batch of one unwrapped, text parts joined,
    token ids checked to fit int32), not the raw body: any body it accepts serializes.
    """
    if isinstance(req, ChatCompletionRequest):
        return b"".join(message_bytes(m["role"], m["content"]) for m in req.messages)
    if isinstance(req.prompt, str):
        return req.prompt.encode()
    # Token ids: 4 bytes each (parse_request refuses ids above MAX_TOKEN_ID = 2^31 - 1), in one
    # C call rather than a Python call per id.
    return struct.pack(f"<{len(req.prompt)}I", *req.prompt)


def message_bytes(role: str, content: str) -> bytes:
    return f"{role}\n{content}\0".encode()


def answer_bytes(text: str, chat: bool) -> bytes:
    """An answer as it comes back in the conversation's next turn."""
    return message_bytes("assistant", text) if chat else text.encode()


def salt_seed(salt: str | None) -> int:
    """Where a prompt's chain starts: 0 for the shared cache, else a hash of its `cache_salt`.
    Every block hash depends on it, so prompts under different salts share no block."""
    return 0 if salt is None else hash(("cache_salt", salt))


def chain(data: bytes, seed: int = 0, block: int = BLOCK_BYTES) -> list[int]:
    """Chained hashes of the full blocks of `data` (a partial last block is not counted),
    starting from `seed` (`salt_seed`, or the last hash of the blocks before `data`)."""
    out: list[int] = []
    h = seed
    for i in range(0, len(data) - block + 1, block):
        # NOTE: Python's hash is salted per process: fine for an index that lives in one.
        h = hash((h, data[i : i + block]))
        out.append(h)
    return out


class TokenEstimate:
    """Bytes per token, learned from prompts whose token count a worker reported."""

    def __init__(self, initial: float = INITIAL_BYTES_PER_TOKEN, weight: float = 0.05) -> None:
        self.bytes_per_token = initial
        self.weight = weight
        self.samples = 0

    def tokens(self, nbytes: int) -> int:
        return int(nbytes / self.bytes_per_token)

    def observe(self, nbytes: int, tokens: int) -> None:
        if nbytes <= 0 or tokens <= 0:
            return
        ratio = nbytes / tokens
        # The first samples move it fast, later ones slowly (an EMA after 1/weight samples).
        self.samples += 1
        w = max(self.weight, 1.0 / self.samples)
        self.bytes_per_token += w * (ratio - self.bytes_per_token)


@dataclass(slots=True)
class PromptKey:
    """A request's prompt as the index sees it."""

    data: bytes
    blocks: list[int]  # empty when the index is off
    seed: int = 0  # the chain's start (`salt_seed` of the request's cache_salt)

    @classmethod
    def of(cls, data: bytes, salt: str | None = None, hashed: bool = True) -> PromptKey:
        seed = salt_seed(salt)
        return cls(data, chain(data, seed) if hashed else [], seed)

    def extended(self, more: bytes) -> list[int]:
        """The chain of the prompt followed by `more` (its answer). The prompt's full blocks are
        not hashed again: learning an answer costs its own length, not the prompt's."""
        done = len(self.blocks)
        seed = self.blocks[-1] if done else self.seed
        return self.blocks + chain(self.data[done * BLOCK_BYTES :] + more, seed)


class PrefixIndex:
    """Per worker URL: the chained block hashes sent there, LRU-bounded and with a TTL."""

    def __init__(
        self,
        max_blocks: int = 1 << 16,
        ttl_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._clock = clock
        self._workers: dict[str, OrderedDict[int, float]] = {}  # url -> hash -> last use

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    def match(self, url: str, blocks: Sequence[int]) -> int:
        """How many leading blocks the worker at `url` is expected to hold."""
        entries = self._workers.get(url)
        if not entries:
            return 0
        oldest = self._clock() - self.ttl_s
        n = 0
        for h in blocks:
            t = entries.get(h)
            if t is None or t < oldest:
                break
            n += 1
        return n

    def insert(self, url: str, blocks: Sequence[int], cap: int | None = None) -> None:
        """Record that `url` now holds `blocks`; evict its least recent beyond `cap` blocks."""
        if not self.enabled or not blocks:
            return
        entries = self._workers.setdefault(url, OrderedDict())
        now = self._clock()
        limit = self.max_blocks if cap is None else max(1, min(cap, self.max_blocks))
        # Tail first, so a chain's head is the most recent: the LRU cuts chains from their end.
        # Beyond `limit` blocks the tail would be cut at once: it is not inserted, so the dict
        # (which never shrinks) holds at most twice `limit` entries, however long the prompt.
        for h in reversed(blocks[:limit]):
            entries[h] = now
            entries.move_to_end(h)
        oldest = now - self.ttl_s
        while entries:
            h, t = next(iter(entries.items()))
            if len(entries) <= limit and t >= oldest:
                break
            del entries[h]

    def forget(self, url: str) -> None:
        self._workers.pop(url, None)

    def blocks(self, url: str) -> int:
        return len(self._workers.get(url, ()))

    @property
    def size(self) -> int:
        """Blocks held, over all workers."""
        return sum(map(len, self._workers.values()))
