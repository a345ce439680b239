"""Constrained decoding with llguidance: a request's constraint compiled once, a matcher per request.

A `Constraint` (`pd.protocol.Constraint`: JSON schema, any JSON object, regex, choice or Lark/GBNF grammar)
becomes llguidance's grammar text, and that a matcher over this worker's vocabulary
(`GrammarCompiler.matcher`). Building the matcher is the costly part (the lexer and parser
tables; llguidance drops the GIL meanwhile, 0.1 to 1 s for huge grammars): it runs on the
compiler's own thread, under a deadline, with an LRU of built matchers keyed by the grammar, so a
request whose grammar was seen before gets a copy (`deep_copy`) of the cached one. A grammar
that does not compile, or not within the deadline, is a 400 naming the problem.

Per request, a `GrammarMatcher` fills the next token's allowed set as a bitmask row (one bit per
token id, llguidance's layout: int32 words, bit i of word w is token 32 w + i) and consumes each
sampled token. JSON is compact by default (no free whitespace between tokens: `max_tokens` is
not spent on spaces); a schema's `"x-guidance": {"whitespace_flexible": true}` allows it.
Schemas and regexes mean what they mean to vLLM users (`strict_schema`: closed objects, ECMA-262
classes) before llguidance reads them.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import numpy as np

from pd.protocol import Constraint
from pd.worker.text.strict_schema import ecma_regex, strict
from pd.worker.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# llguidance's JSON options unless the schema says otherwise (its "x-guidance" key).
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The constraint does not compile (bad schema, regex or grammar), or took too long."""


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for a constraint (not yet checked: building the matcher checks it)."""
    try:
        if c.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_DEFAULTS
            )
        if c.kind == "json_schema":
            schema = strict(json.loads(c.spec))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if c.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ecma_regex(c.spec))
        if c.kind == "choice":
            choices = json.loads(c.spec)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(s) for s in choices)
            )
        if c.kind == "grammar":
            return llguidance.grammar_from("grammar", c.spec)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid {c.kind}: {e}") from None
    raise GrammarError(f"unknown constraint kind {c.kind!r}")


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


class GrammarCompiler:
    """Matchers for constraints over one tokenizer: built on a thread of their own under a
    deadline, cached by grammar (LRU of `cache_size`)."""

    def __init__(
        self, tok: Tokenizer, vocab_size: int, timeout_s: float = 10.0, cache_size: int = 256
    ) -> None:
        # The model's vocabulary may be padded past the tokenizer's: masks cover the model's rows.
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos = frozenset(tok.eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._source = tok  # llguidance's tokenizer is built on the first compile (~0.25 s)
        self._tok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the cache is read on the loop and written on the thread
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pd-grammar")
        self.compiles = 0  # matchers built (cache misses), for tests and metrics

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def matcher(self, c: Constraint) -> GrammarMatcher:
        """A fresh matcher for `c`. Raises GrammarError when it does not compile in time."""
        grammar = grammar_text(c)
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                return self._wrap(cached.deep_copy())
        loop = asyncio.get_running_loop()
        build = loop.run_in_executor(self._executor, self._build, grammar)
        try:
            template = await asyncio.wait_for(build, self.timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"the {c.kind} did not compile within {self.timeout_s:g}s: simplify it"
            ) from None
        return self._wrap(template.deep_copy())

    def matcher_now(self, c: Constraint) -> GrammarMatcher:
        """`matcher` on the caller's thread (tests, benchmarks)."""
        return self._wrap(self._build(grammar_text(c)).deep_copy())

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            cached = self._cache.get(grammar)
        if cached is not None:
            return cached
        if self._tok is None:  # on the compile thread, like every build
            self._tok = llguidance.LLTokenizer(
                self._source.backend.to_str(),
                n_vocab=self.vocab_size,
                eos_token=sorted(self.eos) or None,
            )
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(" ".join(m.get_error().split())[:500])
        self.compiles += 1
        with self._lock:
            self._cache[grammar] = m
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m

    def _wrap(self, m: llguidance.LLMatcher) -> GrammarMatcher:
        return GrammarMatcher(m, self.words, self.eos)
