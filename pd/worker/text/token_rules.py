"""What a request's next token may be: its grammar (structured outputs), `min_tokens`, vLLM's
`allowed_token_ids` and `bad_words`, written as one allowed-token bitmask row per step.

The runner asks each sampled request that has rules for its row (`fill_mask`, on the forward
thread, after the previous step's token was accepted) and the sampler masks the logits with it in
every path (greedy, top-k, top-p, min-p, penalties, seeds). The engine accepts each sampled token
(`accept`, in order, P's first token included on D) so the grammar advances once per token.

Bitmask layout (llguidance's): int32 words, bit i of word w allows token 32 w + i.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from pd.protocol import GenerationOptions
from pd.worker.text.grammar import GrammarCompiler, GrammarMatcher
from pd.worker.text.tokenizer import Tokenizer


def set_bits(row: np.ndarray, ids: Iterable[int], value: bool) -> None:
    """Allow (`value`) or forbid each token id of `ids` in a bitmask row (ids past it ignored).
    Vectorized: a vocabulary's worth of ids costs milliseconds, not a Python loop each."""
    words = row.view(np.uint32)
    t = np.fromiter(ids, np.int64)
    t = t[(t >= 0) & (t < 32 * words.size)]
    if not t.size:
        return
    w, bits = t >> 5, np.left_shift(np.uint32(1), (t & 31).astype(np.uint32))
    if value:
        np.bitwise_or.at(words, w, bits)
    else:
        np.bitwise_and.at(words, w, ~bits)


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows (tests, debugging)."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.nonzero(bits)[0]


class TokenRules:
    """A request's rules for its next token. `stop_ids` (EOS and the request's stop token ids)
    are forbidden while fewer than `min_tokens` tokens are out; `bad_words` are token sequences
    whose last token is forbidden whenever the output ends with the rest of one."""

    def __init__(
        self,
        words: int,
        *,
        grammar: GrammarMatcher | None = None,
        min_tokens: int = 0,
        stop_ids: frozenset[int] = frozenset(),
        allowed: Sequence[int] | None = None,
        bad_words: Sequence[Sequence[int]] = (),
    ) -> None:
        self.words = words
        self.grammar = grammar
        self.min_tokens = min_tokens
        self.stop_ids = sorted(stop_ids)
        self._allowed: np.ndarray | None = None
        if allowed is not None:
            self._allowed = np.zeros(words, np.int32)
            set_bits(self._allowed, list(allowed) + self.stop_ids, True)  # it may always stop
        self.bad_words = [list(w) for w in bad_words if w]
        self.rejected: int | None = None  # a token the grammar did not take (ends the request)

    def fill_mask(self, row: np.ndarray, output_ids: Sequence[int]) -> None:
        """Write the tokens allowed after `output_ids` into `row` (int32, all ones on entry)."""
        if self.grammar is not None:
            self.grammar.fill_mask(row)
            if not row.any():  # the grammar failed: only stopping is left
                set_bits(row, self.grammar.eos, True)
        if self._allowed is not None:
            np.bitwise_and(row, self._allowed, out=row)
        if len(output_ids) < self.min_tokens:
            set_bits(row, self.stop_ids, False)
        for word in self.bad_words:
            prefix = word[:-1]
            if not prefix or list(output_ids[len(output_ids) - len(prefix) :]) == prefix:
                set_bits(row, word[-1:], False)
        if not row.any():  # every rule together left nothing: let it stop rather than fail
            set_bits(row, self.stop_ids, True)

    def accept(self, token: int) -> bool:
        """The sampled token, in order; False when the grammar does not take it."""
        if self.grammar is None or self.grammar.consume(token):
            return True
        self.rejected = token
        return False

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more but stopping: the output is complete."""
        return self.grammar is not None and self.grammar.done


async def rules_for(
    options: GenerationOptions, tok: Tokenizer, grammars: GrammarCompiler
) -> TokenRules | None:
    """The rules a request's options ask for (None: it may sample anything). Its grammar is
    compiled off the event loop (raises GrammarError: the caller answers a 400)."""
    o = options
    if (
        o.constraint is None
        and not o.min_tokens
        and o.allowed_token_ids is None
        and not o.bad_words
    ):
        return None
    grammar = await grammars.matcher(o.constraint) if o.constraint is not None else None
    bad: dict[tuple[int, ...], None] = {}  # in order, once each
    for word in o.bad_words:  # as vLLM: the word alone and after a space
        for text in (word.lstrip(), " " + word.lstrip()):
            if ids := tuple(tok.encode(text)):
                bad[ids] = None
    return TokenRules(
        grammars.words,
        grammar=grammar,
        min_tokens=o.min_tokens,
        stop_ids=frozenset(tok.eos_token_ids) | frozenset(o.stop_token_ids),
        allowed=o.allowed_token_ids,
        bad_words=list(bad),
    )
