"""Prompt text of an exact token length, for the served model's tokenizer.

Words are vocabulary tokens that decode to " word" (a space and 3-8 lowercase letters) and encode
back to themselves alone; a byte-level BPE splits text at spaces before merging, so a string of n
such words encodes to exactly n tokens. Blocks of words are drawn from seeded generators: the same
seed gives the same block, which is how a trace's equal `hash_ids` become equal prompt prefixes.
"""

from __future__ import annotations

import random
import re
from typing import Protocol

WORD = re.compile(r" [a-z]{3,8}")
MIN_WORDS = 256


class TextTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TokenText:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        words, ids = [], []
        for token_id in range(tokenizer.vocab_size):
            text = tokenizer.decode([token_id], False)
            if WORD.fullmatch(text) and tokenizer.encode(text) == [token_id]:
                words.append(text)
                ids.append(token_id)
        if len(words) < MIN_WORDS:
            raise ValueError(
                f"the tokenizer has only {len(words)} plain-word tokens (need {MIN_WORDS}): "
                "prompts of exact lengths cannot be built from it"
            )
        self.words = words
        self.word_ids = ids  # each word's token id

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def random_ids(self, n: int, rng: random.Random) -> list[int]:
        """`n` token ids of words drawn from `rng` (the words `random` draws from the same
        state): a prompt that no server has to tokenize."""
        return rng.choices(self.word_ids, k=n)

    def random(self, n: int, rng: random.Random) -> str:
        """`n` tokens of words drawn from `rng`."""
        return "".join(rng.choices(self.words, k=n))

    def block_words(self, seed: int | str, n: int) -> list[str]:
        """`n` words (one token each) that depend on `seed` alone."""
        return random.Random(f"block:{seed}").choices(self.words, k=n)

    def block(self, seed: int | str, n: int) -> str:
        """`n` tokens that depend on `seed` alone."""
        return "".join(self.block_words(seed, n))
