"""Constrained decoding with llguidance: a request's constraint compiled once, a matcher per request.

A `Constraint` (`pd.protocol.Constraint`: JSON schema, any JSON object, regex, choice or Lark/GBNF
grammar) becomes llguidance's grammar text (`grammar_source`), and that a matcher over this
worker's vocabulary (`GrammarCompiler.matcher`). A client's constraint never compiles first in
the worker: its size limits are checked (`grammar_source.check_limits`), then it compiles in a
grammar child (`grammar_pool`: its own process, memory capped, killed at `--grammar-timeout-s`),
and only a grammar that compiled there is built here, on a thread of the same stack size
(`stack_threads`). Building is the costly part (the lexer and parser tables; llguidance drops
the GIL meanwhile, seconds for huge grammars: docs/EXPERIMENTS.md §16); an LRU of built
matchers keyed by the constraint gives a request seen before a copy (`deep_copy`) of the cached
one. A constraint that does not compile, is over a limit, crashes its child or runs past the
deadline is a 400 naming the problem.

Per request, a `GrammarMatcher` fills the next token's allowed set as a bitmask row (one bit per
token id, llguidance's layout: int32 words, bit i of word w is token 32 w + i) and consumes each
sampled token. JSON is compact by default (no free whitespace between tokens: `max_tokens` is
not spent on spaces); a schema's `"x-guidance": {"whitespace_flexible": true}` allows it.
Schemas and regexes mean what they mean to vLLM users (`strict_schema`: closed objects, ECMA-262
classes) before llguidance reads them.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import numpy as np

from pd.protocol import Constraint
from pd.worker.text.grammar_pool import GrammarPool, GrammarUnavailable
from pd.worker.text.grammar_source import (
    GrammarError,
    build_matcher,
    check_limits,
    grammar_text,
    new_tokenizer,
)
from pd.worker.text.stack_threads import GRAMMAR_STACK_BYTES, StackThreads
from pd.worker.text.tokenizer import Tokenizer

__all__ = ["GrammarCompiler", "GrammarError", "GrammarMatcher", "GrammarUnavailable"]


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: the engine consumes tokens and
    fills masks in turn, never at once (a step's mask is filled after the previous step's token
    was consumed)."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, eos: frozenset[int]) -> None:
        self._m = matcher
        self.words = words  # int32 words of a mask row
        self.eos = eos
        self.consumed = 0  # tokens consumed, EOS included

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (int32, `words` long, contiguous)."""
        assert row.dtype == np.int32 and row.size == self.words and row.flags["C_CONTIGUOUS"]
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar did not allow it (an error state:
        the request should end)."""
        self.consumed += 1
        return bool(self._m.consume_token(token))

    @property
    def done(self) -> bool:
        """The grammar allows nothing more but EOS (or it failed): the output is complete."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str:
        return str(self._m.get_error())


# What a compiled matcher is reckoned to hold in memory (the cache's bound is in these bytes):
# llguidance does not say, so these round up what RSS showed for matchers of SmolLM2's
# vocabulary (docs/EXPERIMENTS.md §23).
MATCHER_BASE_BYTES = 256 << 10
MATCHER_BYTES_PER_CHAR = 128


def matcher_bytes(grammar: str) -> int:
    """The memory a matcher of `grammar` (its text, as compiled) is reckoned at."""
    return MATCHER_BASE_BYTES + MATCHER_BYTES_PER_CHAR * len(grammar)


class GrammarCompiler:
    """Matchers for constraints over one tokenizer: each constraint checked in a grammar child,
    then built on a thread of the child's stack size under a deadline, and cached by constraint
    (LRU of at most `cache_size` matchers and `cache_bytes` of their reckoned memory,
    `matcher_bytes`: one larger than that is not kept)."""

    def __init__(
        self,
        tok: Tokenizer,
        vocab_size: int,
        timeout_s: float = 10.0,
        cache_size: int = 256,
        cache_bytes: int = 256 << 20,
        children: int = 2,
        memory_mb: int = 1024,
        stack_bytes: int = GRAMMAR_STACK_BYTES,
    ) -> None:
        # The model's vocabulary may be padded past the tokenizer's: masks cover the model's rows.
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos = frozenset(tok.eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0  # reckoned memory of the cached matchers
        self._sizes: dict[tuple[str, str], int] = {}
        # llguidance's tokenizer is built on the first compile (most of that compile's time:
        # docs/BENCHMARKS.md, "Structured outputs")
        self._source = tok
        self._tok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the cache is read on the loop and written on a thread
        self.pool = GrammarPool(self._setup, children, memory_mb, stack_bytes)
        self._threads = StackThreads(max(1, children), stack_bytes, "pd-grammar")
        self.compiles = 0  # matchers built (cache misses), for tests and metrics

    def close(self) -> None:
        self.pool.close()
        self._threads.close()

    async def aclose(self) -> None:
        await self.pool.aclose()
        self._threads.close()

    async def matcher(self, c: Constraint) -> GrammarMatcher:
        """A fresh matcher for `c`. Raises GrammarError when it is over a limit or does not
        compile in time (in its child), GrammarUnavailable when no child could take it."""
        key = (c.kind, c.spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return self._wrap(cached.deep_copy())
        check_limits(c.kind, c.spec)
        grammar = await self.pool.check(c.kind, c.spec, self.timeout_s)
        build = asyncio.wrap_future(self._threads.submit(self._build, key, grammar))
        try:
            template = await asyncio.wait_for(build, self.timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"the {c.kind} did not compile within {self.timeout_s:g}s: simplify it"
            ) from None
        return self._wrap(template.deep_copy())

    def matcher_now(self, c: Constraint) -> GrammarMatcher:
        """A matcher built on the caller's thread, with no child: for constraints the caller
        wrote (tests, benchmarks), never a client's."""
        check_limits(c.kind, c.spec)
        return self._wrap(self._build((c.kind, c.spec), grammar_text(c.kind, c.spec)).deep_copy())

    def _setup(self) -> dict[str, Any]:
        """The grammar children's tokenizer (their first message)."""
        return {
            "tokenizer": self._source.backend.to_str(),
            "n_vocab": self.vocab_size,
            "eos": sorted(self.eos),
        }

    def _build(self, key: tuple[str, str], grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        if self._tok is None:
            self._tok = new_tokenizer(
                self._source.backend.to_str(), self.vocab_size, sorted(self.eos)
            )
        m = build_matcher(self._tok, grammar)
        self.compiles += 1
        size = matcher_bytes(grammar)
        if size > self.cache_bytes:
            return m  # used by this request alone
        with self._lock:
            if key not in self._cache:
                self._cache[key] = m
                self._sizes[key] = size
                self.cached_bytes += size
            while len(self._cache) > self.cache_size or self.cached_bytes > self.cache_bytes:
                old, _ = self._cache.popitem(last=False)
                self.cached_bytes -= self._sizes.pop(old)
        return m

    def _wrap(self, m: llguidance.LLMatcher) -> GrammarMatcher:
        return GrammarMatcher(m, self.words, self.eos)
