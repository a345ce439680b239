"""vLLM's `/tokenize` and `/detokenize`: what evaluators (lm-eval) and UIs probe to count and
read tokens with the model's own tokenizer.

`POST /tokenize` takes `{"prompt": str}` or `{"messages": [...]}` (rendered by the chat template
as a chat completion's prompt is) and answers `{"count", "max_model_len", "tokens",
"token_strs"}`: the ids a completion or chat request with that prompt would use. `POST
/detokenize` takes `{"tokens": [int]}` and answers `{"prompt": str}`. Both check `model` as the
OpenAI endpoints do; unknown and unserved fields are a 400, as everywhere.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import orjson

from pd.protocol import (
    MAX_TOKENIZE_CHARS,
    APIError,
    ChatCompletionRequest,
    bad_request,
    unknown_parameter,
    unsupported_parameter,
)
from pd.worker.api.prompt import PromptBuilder, checked_token_ids

# Per field: the values that ask for what pd does anyway (any value when None).
_TOKENIZE_FIELDS: dict[str, tuple[Any, ...] | None] = {
    "model": None,
    "prompt": None,
    "messages": None,
    "add_special_tokens": None,
    "add_generation_prompt": None,
    "return_token_strs": None,
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "tools": None,
    "mm_processor_kwargs": ({},),
}
LARGE_ANSWER_TOKENS = 4096  # an answer this long is built on the text thread
_DETOKENIZE_FIELDS: dict[str, tuple[Any, ...] | None] = {"model": None, "tokens": None}


def _check_fields(
    body: dict[str, Any], known: dict[str, tuple[Any, ...] | None], ignore_unknown: bool
) -> None:
    for name, value in body.items():
        if value is None:
            continue
        if name not in known:
            if ignore_unknown:
                continue
            raise unknown_parameter(name)
        noop = known[name]
        if noop is not None and not any(value == v for v in noop):
            raise unsupported_parameter(name, "not served by /tokenize")


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", param=name, code="invalid_type")
    return value


async def tokenize(
    prompts: PromptBuilder,
    body: dict[str, Any],
    max_model_len: int,
    ignore_unknown: bool = False,
) -> bytes:
    """The answer to a `/tokenize` body, as JSON (a 400 for a bad one). A prompt longer than the
    context is counted, not refused (counting is what the endpoint is for), up to
    MAX_TOKENIZE_CHARS."""
    _check_fields(body, _TOKENIZE_FIELDS, ignore_unknown)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
    # The ids pd's own endpoints use: special tokens are never added (docs/api.md).
    add_special = _flag(body, "add_special_tokens", False)
    if has_messages:  # parsed as a chat request's: tools rendered (or pd's tool prompt) too
        chat = {"messages": body["messages"], "tools": body.get("tools")}
        req = ChatCompletionRequest.parse(chat)
        text = await prompts.render(
            req.messages, _flag(body, "add_generation_prompt", True), req.tools
        )
    else:
        text = body["prompt"]
        if not isinstance(text, str):
            raise bad_request("'prompt' must be a string", param="prompt", code="invalid_type")
    if len(text) > MAX_TOKENIZE_CHARS:
        raise bad_request(
            f"/tokenize counts texts of at most {MAX_TOKENIZE_CHARS} characters (any prompt "
            f"this model takes is shorter); this one has {len(text)}",
            param="prompt",
            code="prompt_too_large",
        )
    ids = await prompts.encode(text, add_special)
    tok = prompts.tok
    want_strs = _flag(body, "return_token_strs", False)

    def answer() -> bytes:  # off the loop for long prompts: a string per token, then JSON
        head = b'{"count":%d,"max_model_len":%d,"tokens":' % (len(ids), max_model_len)
        if not want_strs:
            return head + json_list(ids) + b',"token_strs":null}'
        table = tok.token_strings
        strs = [table[t] if t < len(table) else None for t in ids]
        return head + json_list(ids) + b',"token_strs":' + json_list(strs) + b"}"

    return await prompts.off_loop(len(ids) >= LARGE_ANSWER_TOKENS, answer)


async def detokenize(
    prompts: PromptBuilder, body: dict[str, Any], ignore_unknown: bool = False
) -> dict[str, Any]:
    """The answer to a `/detokenize` body: the text of its token ids (special tokens kept)."""
    _check_fields(body, _DETOKENIZE_FIELDS, ignore_unknown)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise bad_request("'tokens' must be a list of token ids", param="tokens")
    ids = checked_token_ids(tokens, prompts.tok.vocab_size, "tokens")
    return {"prompt": await prompts.decode(ids)}


def json_list(values: list[Any], chunk: int = 32768) -> bytes:
    """A JSON array, written a slice at a time: each orjson call holds the GIL for a few
    milliseconds at most, so the event loop runs between them."""
    if len(values) <= chunk:
        return orjson.dumps(values)
    parts = [orjson.dumps(values[i : i + chunk])[1:-1] for i in range(0, len(values), chunk)]
    return b"[" + b",".join(parts) + b"]"


def check_model(req_model: Any, accepted: Collection[str], served: str) -> None:
    """A 404 for a model this worker does not serve (None: the served one)."""
    if req_model is None:
        return
    if not isinstance(req_model, str):
        raise bad_request("'model' must be a string", param="model", code="invalid_type")
    if req_model not in accepted:
        raise APIError(
            404,
            f"model '{req_model}' does not exist; this worker serves '{served}'",
            "invalid_request_error",
            "model_not_found",
            "model",
        )


__all__ = ["check_model", "detokenize", "tokenize"]
