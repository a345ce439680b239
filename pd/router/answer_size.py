"""The byte bound of a non-streamed answer (`--max-answer-bytes`): the router builds such an
answer from the worker's stream, holding all of it at once (as Python objects, ~6 times its
JSON), so one request with `n` choices of many tokens and 20 alternatives a token could take
the router's memory. Two checks keep it within the bound:

- before any work, `expected_bytes`: what the answer is expected to weigh at most from the
  request alone (its choices, `max_tokens`, logprobs and the prompt's part), at typical sizes
  of a token's text and of a logprob entry; over the bound it is a 400 that says to stream (a
  stream is relayed as it comes, never held) or to ask for less. Without `max_tokens` the
  generated part cannot be told in advance and only the second check holds;
- while collecting, the bytes the worker sent so far (`SSECollector`): past the bound the
  worker's stream is closed (its request aborted, its pages freed) and the client gets a 400.
"""

from __future__ import annotations

from pd.protocol import APIError, ChatCompletionRequest, CompletionRequest

# A typical token's JSON in a stream event's text (a token is ~4 characters of English).
TOKEN_BYTES = 8
# One logprob entry: the chosen token's or an alternative's. Chat: {"token": ..., "logprob":
# ..., "bytes": [...]} (~60 bytes); completions: a token and its logprob in two lists or a
# dict (~25 bytes).
CHAT_ENTRY_BYTES = 60
COMPLETION_ENTRY_BYTES = 25
CHOICE_BYTES = 200  # a choice's own fields, the answer's id, usage


def expected_bytes(
    req: CompletionRequest | ChatCompletionRequest, prompts: int, prompt_tokens: int
) -> int | None:
    """The answer's expected size at most (None: unknown, no max_tokens); `prompt_tokens`: the
    router's estimate of one prompt's tokens."""
    o = req.options
    if o.max_tokens is None:
        return None
    chat = isinstance(req, ChatCompletionRequest)
    entry = CHAT_ENTRY_BYTES if chat else COMPLETION_ENTRY_BYTES
    per_token = TOKEN_BYTES + (entry * (1 + o.top_logprobs) if o.wants_logprobs else 0)
    prompt_part = 0
    if isinstance(req, CompletionRequest) and req.echo:
        prompt_part += prompt_tokens * TOKEN_BYTES
    if o.prompt_logprobs is not None:
        prompt_part += prompt_tokens * entry * (1 + o.prompt_logprobs)
    per_choice = CHOICE_BYTES + o.max_tokens * per_token + prompt_part
    return prompts * req.n * per_choice


def too_large(limit: int, size: int | None = None) -> APIError:
    """The 400 of an answer over `limit` (`size`: expected in advance; None: found while
    collecting)."""
    what = (
        f"this request's answer is expected to take up to {size} bytes"
        if size is not None
        else "this request's answer grew"
    )
    return APIError(
        400,
        f"{what}, over this router's limit of {limit} bytes for an answer it assembles "
        "(--max-answer-bytes): ask for it with stream=true, or for fewer tokens, choices or "
        "logprobs",
        "invalid_request_error",
        "answer_too_large",
        None,
    )


def check_expected(
    req: CompletionRequest | ChatCompletionRequest, prompts: int, prompt_tokens: int, limit: int
) -> None:
    """A 400 when a non-streamed answer is expected to take more than `limit` bytes."""
    if req.stream:
        return
    size = expected_bytes(req, prompts, prompt_tokens)
    if size is not None and size > limit:
        raise too_large(limit, size)
