"""The prompt's part of a completion: `echo`'s text and logprobs, and vLLM's `prompt_logprobs`.

Built once a request's first token (or, with max_tokens 0, its end) is out, when the engine has
the prompt's logprobs (`Sequence.prompt_logprobs`: entry p for prompt token p + 1, computed on the
worker that prefilled the prompt, and carried in `kv_transfer_params` from P to D). The first
prompt token has no logprob (nothing predicts it): `null`, as OpenAI and vLLM answer it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pd.worker.text.detokenizer import Decoder, IncrementalDetokenizer

# (logprob of the prompt token at its position, its rank, [(token id, logprob)] alternatives)
Computed = Sequence[tuple[float, int, list[tuple[int, float]]]]
# One echoed token: (token id, its logprob or None, [(token id, logprob)] alternatives or None)
EchoEntry = tuple[int, float | None, list[tuple[int, float]] | None]


@dataclass
class PromptPart:
    text: str = ""  # echoed before the completion's text ("" without echo)
    entries: list[EchoEntry] = field(default_factory=list)  # echo with logprobs: per prompt token
    offsets: list[int] = field(default_factory=list)  # text_offset of each entry
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's (None: not asked)


def prompt_part(
    prompt_ids: list[int],
    computed: Computed,
    tokenizer: Decoder,
    token_text: Callable[[int], str],
    *,
    echo: bool,
    echo_logprobs: int | None,  # completions' `logprobs` with echo (None: no logprobs)
    prompt_logprobs: int | None,  # vLLM's `prompt_logprobs` (None: not asked)
) -> PromptPart:
    part = PromptPart()
    if echo:
        # The prompt's ids decoded (special tokens shown), and where each token's text starts.
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        pieces, size = [], 0
        for t in prompt_ids:
            part.offsets.append(size)
            piece = detok.add(t)
            pieces.append(piece)
            size += len(piece)
        pieces.append(detok.flush())
        part.text = "".join(pieces)
        if echo_logprobs is not None:
            part.entries.append((prompt_ids[0], None, None))
            for t, (lp, _, top) in zip(prompt_ids[1:], computed):
                part.entries.append((t, lp, top[:echo_logprobs]))
        else:
            part.offsets = []
    if prompt_logprobs is not None:
        out: list[dict[str, Any] | None] = [None]
        for t, (lp, rank, top) in zip(prompt_ids[1:], computed):
            entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": token_text(t)}}
            for r, (alt, alt_lp) in enumerate(top[:prompt_logprobs], 1):
                entry.setdefault(
                    str(alt), {"logprob": alt_lp, "rank": r, "decoded_token": token_text(alt)}
                )
            out.append(entry)
        part.prompt_logprobs = out
    return part


def once(build: Callable[[], PromptPart]) -> Callable[[], PromptPart]:
    """`build`, run once whoever asks first: a prompt's n choices share one part (it is read,
    never written). Thread-safe: choices may ask from the text thread and the loop at once."""
    lock = threading.Lock()
    built: list[PromptPart] = []

    def get() -> PromptPart:
        with lock:
            if not built:
                built.append(build())
            return built[0]

    return get
