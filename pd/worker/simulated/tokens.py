"""The simulated worker's tokens: deterministic, word-like, never EOS or a special token.

Token `i` of a request's output is a function of the request's prompt ids, its seed (when it has
one) and `i` alone: a 64-bit hash (splitmix64 over a blake2b digest of the prompt: never Python's
salted `hash`) picks one of a fixed set of ordinary word tokens of the tokenizer (" the", " and",
... : a space and 3 to 8 lowercase ASCII letters), so the text reads as words. Hence the same
request gives the same ids on a co-located worker, on P (output position 0) then D (1, 2, ...),
and after a migration (a continuation's outputs start with the given ids: position
`len(output_ids)`), whatever else is in the batch. Outputs end by `max_tokens`, a stop string or
a stop id: a simulated model never ends a text on its own. A request's token rules (a grammar,
`allowed_token_ids`, `min_tokens`, `bad_words`) are obeyed: when the hashed word is masked, the
next words in hash order are tried, then any allowed token of printable ASCII (JSON's braces and
digits), then any allowed id that is not special, and only then whatever the mask allows (EOS,
when a grammar is complete).

Logprobs are fixed: the chosen token `CHOSEN_LOGPROB`, alternatives below it (other words).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from pd.worker.text.tokenizer import Tokenizer

MAX_WORDS = 4096  # the word set: the tokenizer's first this many word tokens (in id order)
WORD_PROBES = 16  # masked words tried in hash order before any allowed id
CHOSEN_LOGPROB = -0.5
ALTERNATIVE_STEP = 1.0  # each alternative's logprob is this much below the previous one
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """One round of splitmix64: a cheap, well-mixed 64-bit hash of a 64-bit integer."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def prompt_key(prompt_ids: Sequence[int], seed: int | None) -> int:
    """64 bits standing for a request's prompt (and seed): what every output token derives from."""
    digest = hashlib.blake2b(np.asarray(prompt_ids, dtype=np.uint32).tobytes(), digest_size=8)
    if seed is not None:
        digest.update(b"seed:%d" % seed)
    return int.from_bytes(digest.digest(), "little")


def word_ids(tokenizer: Tokenizer, limit: int = MAX_WORDS) -> list[int]:
    """The tokenizer's ordinary word tokens: a leading space (byte-level "Ġ" or SentencePiece
    "▁") and 3 to 8 lowercase ASCII letters, never special, first `limit` in id order."""
    special = set(tokenizer.backend.get_added_tokens_decoder()) | set(tokenizer.eos_token_ids)
    words = []
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(i) or ""
        body = piece[1:]
        if (
            piece[:1] in ("Ġ", "▁")
            and 3 <= len(body) <= 8
            and body.isascii()
            and body.isalpha()
            and body.islower()
            and i not in special
        ):
            words.append(i)
            if len(words) == limit:
                break
    if len(words) < 2:
        raise ValueError("the tokenizer has no ordinary word tokens to simulate text with")
    return words


class TokenPicker:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        self.words = word_ids(tokenizer)
        self.vocab_size = vocab_size or tokenizer.vocab_size
        special = set(tokenizer.backend.get_added_tokens_decoder()) | set(tokenizer.eos_token_ids)
        # Per id: 0 special (or past the tokenizer), 1 ordinary, 2 ordinary printable ASCII.
        self._kind = np.zeros(self.vocab_size, dtype=np.int8)
        for i in range(min(self.vocab_size, tokenizer.vocab_size)):
            if i not in special:
                piece = (tokenizer.id_to_token(i) or "").replace("Ġ", " ").replace("▁", " ")
                self._kind[i] = 2 if piece.isascii() and piece.isprintable() and piece else 1

    def token(self, key: int, position: int, mask: np.ndarray | None = None) -> int:
        """Output token `position` of the request whose `prompt_key` is `key`; `mask`: its
        allowed-token bitmask row (int32 words, bit i of word w: token 32 w + i), or None."""
        h = splitmix64(key ^ splitmix64(position))
        n = len(self.words)
        if mask is None:
            return self.words[h % n]
        bits = mask.view(np.uint32)
        for probe in range(WORD_PROBES):
            t = self.words[(h + probe * _GOLDEN) % n]
            if bits[t >> 5] >> (t & 31) & 1:
                return t
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
        allowed = allowed[allowed < self.vocab_size]
        if not allowed.size:  # nothing allowed at all: the rules end the request on this token
            return self.words[h % n]
        kinds = self._kind[allowed]
        for want in (2, 1, 0):
            pool = allowed[kinds >= want]
            if pool.size:
                return int(pool[h % pool.size])
        raise AssertionError("unreachable: kind >= 0 holds for every allowed id")

    def alternatives(self, chosen: int, k: int) -> list[tuple[int, float]]:
        """`k` most likely (token, logprob) at a position whose chosen token is `chosen`: it
        first, then other words, each `ALTERNATIVE_STEP` less likely."""
        if k <= 0:
            return []
        out = [(chosen, CHOSEN_LOGPROB)]
        at = 0
        while len(out) < k:
            t = self.words[at % len(self.words)]
            at += 1
            if t != chosen:
                out.append((t, CHOSEN_LOGPROB - ALTERNATIVE_STEP * len(out)))
        return out
