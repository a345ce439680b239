"""From a parsed OpenAI request to what the engine takes: prompt token ids, and whether a
prefill worker keeps the KV for a decode worker."""

from __future__ import annotations

from pd.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request
from pd.worker.text import Tokenizer

Request = CompletionRequest | ChatCompletionRequest


def prompt_ids(tok: Tokenizer, req: Request) -> list[int]:
    """The prompt's token ids: the chat template applied and encoded, the text encoded, or the
    client's ids (checked against the vocabulary)."""
    if isinstance(req, ChatCompletionRequest):
        try:
            text = tok.apply_chat_template(req.messages, add_generation_prompt=True)
        except Exception as e:  # a template's raise_exception, or a malformed conversation
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        return tok.encode(text)
    if isinstance(req.prompt, str):
        return tok.encode(req.prompt)
    bad = [t for t in req.prompt if t >= tok.vocab_size]
    if bad:
        raise bad_request(
            f"token id {bad[0]} is out of the vocabulary (size {tok.vocab_size})", param="prompt"
        )
    return list(req.prompt)


def wants_remote_decode(role: str, req: Request) -> bool:
    """Prefill role: `kv_transfer_params={"do_remote_decode": true}` (set by the router) asks to
    keep the KV for a decode worker; without it a prefill worker answers like any other."""
    kvp = req.kv_transfer_params
    if kvp is None:
        return False
    if role != "prefill" or kvp.get("do_remote_decode") is not True:
        raise bad_request(
            f"this {role} worker does not take kv_transfer_params {kvp}",
            param="kv_transfer_params",
        )
    if req.stream:
        raise bad_request("a remote-decode prefill answers with stream=false", param="stream")
    asked = kvp.get("max_tokens")
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
        raise bad_request(
            "kv_transfer_params.max_tokens must be a positive integer", param="kv_transfer_params"
        )
    return True


def decode_max_tokens(req: Request) -> int | None:
    """The client's `max_tokens`, which the router passes to P in `kv_transfer_params` so that
    P refuses, before prefilling, a request no decode worker could take."""
    kvp = req.kv_transfer_params or {}
    asked = kvp.get("max_tokens")
    return asked if isinstance(asked, int) else None
