"""The field table: every OpenAI/vLLM request field pd serves, accepts or refuses by name
(`FIELDS`, `check_fields`), and the 400s for the ones it does not serve.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pd.protocol.errors import APIError, bad_request, clip

log = logging.getLogger("pd.protocol")

SERVED, ACCEPTED, REFUSED = "served", "accepted", "refused"


@dataclass(frozen=True)
class FieldRule:
    """What pd does with one request field (docs/api.md lists the same table).

    served: it changes the output as it says (validated by the parsers above); accepted: it
    does nothing here and changes no output (OpenAI platform fields such as `store`); refused: a
    400 `unsupported_parameter`, unless its value is `noop` (the value that asks for nothing, such
    as `echo: false`): nothing that would change the output is accepted and ignored."""

    status: str
    note: str
    endpoint: str = "both"  # "both", "chat" or "completions"
    noop: tuple[Any, ...] = ()  # values of a refused field that ask for nothing


def _rule(status: str, note: str, endpoint: str = "both", *noop: Any) -> FieldRule:
    return FieldRule(status, note, endpoint, noop)


_SAMPLING = "sampling (vLLM extra)"
FIELDS: dict[str, FieldRule] = {
    # -- the prompt
    "messages": _rule(SERVED, "the conversation, rendered by the model's chat template", "chat"),
    "prompt": _rule(SERVED, "text or token ids, or a list of up to 64 of those (prompts x n at "
                    "most 64)", "completions"),
    "model": _rule(SERVED, "checked against the served names (404 otherwise)"),
    # -- length and stopping
    "max_tokens": _rule(SERVED, "completions: 16 by default, 0 only with echo; chat: the rest "
                        "of the context"),
    "max_completion_tokens": _rule(SERVED, "wins over max_tokens", "chat"),
    "stop": _rule(SERVED, "strings; cut from the output"),
    "stop_token_ids": _rule(SERVED, "vLLM extra"),
    "ignore_eos": _rule(SERVED, "vLLM extra"),
    "min_tokens": _rule(SERVED, "vLLM extra: EOS and stop ids are masked until this many tokens"),
    "include_stop_str_in_output": _rule(SERVED, "vLLM extra: the matched stop string is kept"),
    # -- sampling
    "temperature": _rule(SERVED, "0 (or below 1e-5) is greedy; at most 2"),
    "top_p": _rule(SERVED, "0 means greedy"),
    "top_k": _rule(SERVED, _SAMPLING),
    "min_p": _rule(SERVED, _SAMPLING),
    "presence_penalty": _rule(SERVED, "over the output tokens"),
    "frequency_penalty": _rule(SERVED, "over the output tokens"),
    "repetition_penalty": _rule(SERVED, "vLLM extra: over prompt and output tokens"),
    "seed": _rule(SERVED, "the same text however the request is batched or routed"),
    "n": _rule(SERVED, "1..16 choices; the prompt is prefilled once"),
    "best_of": _rule(SERVED, "1 only (400 otherwise)", "completions"),
    "logit_bias": _rule(SERVED, "added to the logits of the named token ids, each in [-100, 100]"),
    "allowed_token_ids": _rule(SERVED, "vLLM extra: the only tokens it may sample (and stopping)"),
    "bad_words": _rule(SERVED, "vLLM extra: a word's last token is never sampled after the rest"),
    "use_beam_search": _rule(REFUSED, "vLLM extra: no beam search", "both", False),
    "length_penalty": _rule(REFUSED, "vLLM extra: no beam search", "both", 1, 1.0),
    "logits_processors": _rule(REFUSED, "vLLM extra: no custom logits processors"),
    # -- logprobs
    "logprobs": _rule(SERVED, "chat: a boolean; completions: 0..20 alternatives"),
    "top_logprobs": _rule(SERVED, "0..20, with logprobs: true", "chat"),
    "prompt_logprobs": _rule(SERVED, "vLLM extra: 0..20 alternatives per prompt position"),
    "echo": _rule(SERVED, "completions: the prompt before the completion (with logprobs: "
                  "theirs first); chat: false only"),
    "return_tokens_as_token_ids": _rule(REFUSED, "vLLM extra: not served", "both", False),
    "return_token_ids": _rule(REFUSED, "vLLM extra: not served", "both", False),
    # -- structured outputs and tools
    "response_format": _rule(SERVED, "json_object, json_schema (strict or not) constrain it"),
    "structured_outputs": _rule(SERVED, "vLLM extra: json, regex, choice, grammar or json_object"),
    "guided_json": _rule(SERVED, "vLLM extra: the older form of structured_outputs.json"),
    "guided_regex": _rule(SERVED, "vLLM extra: the older form of structured_outputs.regex"),
    "guided_choice": _rule(SERVED, "vLLM extra: the older form of structured_outputs.choice"),
    "guided_grammar": _rule(SERVED, "vLLM extra: a Lark or GBNF grammar"),
    "structural_tag": _rule(REFUSED, "vLLM extra: structured outputs, not served yet"),
    "guided_decoding_backend": _rule(ACCEPTED, "vLLM extra: one backend here, llguidance"),
    "guided_whitespace_pattern": _rule(REFUSED, "vLLM extra: structured outputs, not served"),
    "regex": _rule(SERVED, "SGLang extra: a regex the output matches"),
    "ebnf": _rule(SERVED, "SGLang extra: a GBNF grammar"),
    "json_schema": _rule(SERVED, "SGLang extra: a JSON schema (as a string)"),
    "tools": _rule(SERVED, "function tools, rendered by the chat template (or pd's default "
                   "tool prompt); calls parsed into message.tool_calls", "chat"),
    "tool_choice": _rule(SERVED, "none, auto, required or a named function (the last two "
                         "constrain the output to calls)", "chat"),
    "functions": _rule(REFUSED, "deprecated tool calling: not served (use tools)", "chat", []),
    "function_call": _rule(REFUSED, "deprecated tool calling: not served (use tool_choice)",
                           "chat", "none"),
    "parallel_tool_calls": _rule(SERVED, "false: at most one call", "chat"),
    # -- the chat template
    "add_generation_prompt": _rule(REFUSED, "vLLM extra: always true here", "chat", True),
    "continue_final_message": _rule(REFUSED, "vLLM extra: not served yet", "chat", False),
    "chat_template": _rule(REFUSED, "vLLM extra: the model's template only", "chat"),
    "chat_template_kwargs": _rule(REFUSED, "vLLM extra: not served yet", "chat", {}),
    "documents": _rule(REFUSED, "vLLM extra: not served", "chat", []),
    "add_special_tokens": _rule(REFUSED, "vLLM extra: never added here", "both", False),
    "mm_processor_kwargs": _rule(REFUSED, "vLLM extra: text only", "chat", {}),
    "truncate_prompt_tokens": _rule(REFUSED, "vLLM extra: prompts are never truncated"),
    "suffix": _rule(REFUSED, "fill-in-the-middle is not served (as in vLLM)", "completions", ""),
    # -- output form
    "stream": _rule(SERVED, "SSE with data: [DONE]"),
    "stream_options": _rule(SERVED, "include_usage; only with stream: true"),
    "skip_special_tokens": _rule(SERVED, "vLLM extra"),
    "spaces_between_special_tokens": _rule(REFUSED, "vLLM extra: not served", "both", True),
    "modalities": _rule(REFUSED, "text only", "chat", ["text"]),
    "audio": _rule(REFUSED, "text only", "chat"),
    "reasoning_effort": _rule(REFUSED, "no reasoning models here", "chat"),
    "verbosity": _rule(REFUSED, "not served", "chat"),
    "web_search_options": _rule(REFUSED, "no web search", "chat"),
    "prediction": _rule(ACCEPTED, "predicted outputs speed OpenAI's answers up; the answer "
                        "is the same without it", "chat"),
    # -- scheduling, caching, tenancy
    "priority": _rule(SERVED, "vLLM extra: lower first; the router's priority class and the "
                      "workers' order of waiting requests (docs/api.md)"),
    "cache_salt": _rule(SERVED, "vLLM extra: isolates the prefix cache (docs/security.md)"),
    "user": _rule(SERVED, "a room key for sticky routing"),
    "session_id": _rule(SERVED, "pd extra: a room key for sticky routing"),
    "prompt_cache_key": _rule(ACCEPTED, "OpenAI's cache-routing hint; pd routes by the prompt"),
    "safety_identifier": _rule(ACCEPTED, "OpenAI platform field"),
    "kv_transfer_params": _rule(SERVED, "pd-internal: set by the router only"),
    "pd_continuation": _rule(SERVED, "pd-internal: set by the router only"),
    "request_id": _rule(ACCEPTED, "vLLM extra: pd makes its own ids"),
    "rid": _rule(ACCEPTED, "SGLang extra: pd makes its own ids"),
    "vllm_xargs": _rule(REFUSED, "vLLM extra: not served"),
    # -- OpenAI platform fields
    "store": _rule(ACCEPTED, "OpenAI platform field: nothing is stored"),
    "metadata": _rule(ACCEPTED, "OpenAI platform field (with store)"),
    "service_tier": _rule(ACCEPTED, "OpenAI platform field: one tier here"),
}  # fmt: skip
STREAM_OPTIONS = {"include_usage": SERVED, "continuous_usage_stats": REFUSED}
_warned_unknown: set[str] = set()


def check_fields(body: dict[str, Any], chat: bool, ignore_unknown: bool = False) -> None:
    """Refuse (400 `unsupported_parameter`) a field pd does not serve, and (as OpenAI does) one
    it does not know, unless `ignore_unknown` (vLLM's way: accepted, and logged once per name).
    A field set to null counts as absent."""
    unknown = set(unknown_fields(body, chat))
    for name, value in body.items():
        if value is None:
            continue
        if name in unknown:
            if ignore_unknown:
                _warn_unknown(name)
                continue
            raise unknown_parameter(name)
        rule = FIELDS[name]
        if rule.status == REFUSED and not any(value == v for v in rule.noop):
            raise unsupported_parameter(name, rule.note)
    options = body.get("stream_options")
    if isinstance(options, dict) and options:
        if body.get("stream") is not True:
            raise bad_request(
                "'stream_options' is only allowed with 'stream': true", param="stream_options"
            )
        for name, value in options.items():
            status = STREAM_OPTIONS.get(name)
            if status == REFUSED and value not in (None, False):
                raise APIError(
                    400,
                    f"'stream_options.{name}' is not supported by this server",
                    code="unsupported_parameter",
                    param="stream_options",
                )
            if status is None and not ignore_unknown:
                raise APIError(
                    400,
                    f"Unrecognized request argument supplied: stream_options.{name[:64]}",
                    code="unknown_parameter",
                    param="stream_options",
                )


def unknown_parameter(name: str) -> APIError:
    """The 400 of a field pd does not know (OpenAI's words)."""
    return APIError(
        400,
        f"Unrecognized request argument supplied: {name[:64]}",
        code="unknown_parameter",
        param=name[:64],
    )


def unsupported_parameter(name: str, why: str) -> APIError:
    """The 400 of a field pd knows and does not serve."""
    return APIError(
        400,
        f"'{name}' is not supported by this server ({why})",
        code="unsupported_parameter",
        param=name,
    )


def unknown_fields(body: dict[str, Any], chat: bool) -> list[str]:
    """The fields of `body` that `FIELDS` does not know for its endpoint."""
    endpoint = "chat" if chat else "completions"
    return [
        name
        for name in body
        if (rule := FIELDS.get(name)) is None or rule.endpoint not in ("both", endpoint)
    ]


def _warn_unknown(name: str) -> None:
    if name not in _warned_unknown and len(_warned_unknown) < 1024:  # a client picks the names
        _warned_unknown.add(name)
        log.warning("ignoring unknown request field %r (--ignore-unknown-fields)", clip(name))
