"""Stop strings over streamed text.

Text that could still be the start of a stop string is held back, so a stream never shows part of a
stop string that later completes; it is released as soon as it can no longer match, or by flush().
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stop: tuple[str, ...], include_stop: bool = False) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._stop = tuple(stop)
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: keep the match
        self._held = ""  # emitted-later tail: a proper prefix of some stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, piece: str) -> tuple[str, bool]:
        """Take the next piece of text; return (text safe to emit, whether a stop string hit).

        On a hit the text up to (excluding, or with `include_stop` including) the earliest stop
        string is returned; anything after it, and every later piece, is dropped.
        """
        if self.stopped:
            return "", True
        if not self._stop:
            return piece, False
        text = self._held + piece
        hit = self._earliest(text)
        if hit is not None:
            start, self.matched = hit
            self._held = ""
            self.stopped = True
            return text[: start + len(self.matched) if self.include_stop else start], True
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The text still held back; call once when generation ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _earliest(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the earliest-starting stop string among those complete when the
        first one completes, as if the text arrived one character at a time (so the result does
        not depend on how the text is split into pieces)."""
        ends = [i + len(s) for s in self._stop if (i := text.find(s)) >= 0]
        if not ends:
            return None
        done = text[: min(ends)]
        return min((i, s) for s in self._stop if (i := done.find(s)) >= 0)

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string. Per
        stop string, only the places where its first character occurs in the text's last
        len - 1 characters are tried, earliest (longest) first."""
        best = 0
        n = len(text)
        for s in self._stop:
            i = text.find(s[0], max(0, n - len(s) + 1), n - best)  # longer than the best
            while i >= 0:
                if s.startswith(text[i:]):
                    best = n - i
                    break
                i = text.find(s[0], i + 1, n - best)
        return best
