"""Streamed decoding of generated tokens into text that never shows half a character.

Byte-level tokenizers split a multi-byte UTF-8 character across tokens; decoding such a prefix gives
U+FFFD. Like vLLM and TGI, only a small window of recent tokens is decoded per step: the prefix
(tokens already emitted, kept as context so decoders that strip a leading space see it) and the
pending tokens after it. The new text is decode(window) minus decode(prefix), emitted once it no
longer ends with U+FFFD.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes, so a tail still broken after this many pending tokens (the
# model produced invalid bytes) will not heal; emit it rather than let the window grow.
MAX_PENDING_TOKENS = 16


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # [prefix tokens (emitted) | pending tokens]
        self._read = 0  # window[:read] is the prefix
        self._prefix_text = ""  # decode(window[:read])
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """Take one generated token; return the text it completes (often "", never broken)."""
        self._window.append(token_id)
        full = self._decode(self._window)
        pending = len(self._window) - self._read
        if full.endswith(REPLACEMENT) and pending < MAX_PENDING_TOKENS:
            return ""
        if len(full) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token: nothing new yet
        return self._emit(full)

    def flush(self) -> str:
        """Emit whatever is held back, even an incomplete character; call once at the end."""
        if self._read == len(self._window):
            return ""
        full = self._decode(self._window)
        return self._emit(full) if len(full) > len(self._prefix_text) else ""

    def _emit(self, full: str) -> str:
        new = full[len(self._prefix_text) :]
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._pieces.append(new)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
