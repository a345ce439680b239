"""From a request's body to what the engine takes: the parsed request and its prompt token ids
(whether a prefill worker keeps the KV for a decode worker is its role's: disagg/roles.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson

from pd.protocol import (
    MAX_PROMPTS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    parse_json_body,
    parse_request,
)
from pd.protocol.tools import ToolRequest
from pd.worker.text import Tokenizer
from pd.worker.tools import template_inputs
from pd.worker.tools.prompt import renders_tools

Request = CompletionRequest | ChatCompletionRequest
T = TypeVar("T")


# Bodies, conversations and texts at least this large are parsed, rendered and tokenized on the
# text thread, never on the event loop: a large text takes long enough to tokenize to stall it
# (docs/BENCHMARKS.md, "One request's hold on a worker's event loop"; docs/EXPERIMENTS.md §23).
INLINE_BYTES = 64 << 10


class PromptBuilder:
    """A request's prompt token ids, without stalling the event loop on a large one.

    A prompt that cannot fit the context is refused before it is tokenized: a text of B bytes has
    at least B / `Tokenizer.max_token_bytes` tokens. What is large (`INLINE_BYTES`) is parsed,
    rendered and tokenized on one thread of its own, where jinja2 shares the GIL in switch
    intervals and tokenization releases it (`Tokenizer.encode`)."""

    def __init__(
        self, tok: Tokenizer, max_model_len: int, ignore_unknown_fields: bool = False
    ) -> None:
        self.tok = tok
        self.max_model_len = max_model_len
        self.ignore_unknown_fields = ignore_unknown_fields
        # computed once, here: a pass over the vocabulary (docs/EXPERIMENTS.md §23)
        self.max_token_bytes = tok.max_token_bytes
        self.template_renders_tools = renders_tools(tok.chat_template)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pd-text")

    @property
    def max_body_bytes(self) -> int:
        """The most bytes a request body whose prompt could fit the context takes: each prompt
        byte at most 6 in JSON (a \\u escape), plus 1 MiB for messages and the other fields."""
        return 6 * self.max_model_len * self.max_token_bytes + (1 << 20)

    @property
    def max_commas(self) -> int:
        """The most commas a body within the context holds: a comma per token id (64 prompts
        of ids at most) or at most `max_token_bytes` per token of text, plus the JSON of up
        to 4,096 messages and 128 tools."""
        return self.max_model_len * max(MAX_PROMPTS, self.max_token_bytes) + (1 << 16)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, large: bool, fn: Callable[..., T], *args: Any) -> T:
        if not large:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def off_loop(self, large: bool, fn: Callable[[], T]) -> T:
        """`fn()`, on the text thread when `large` (an answer's echoed prompt, say)."""
        return await self._run(large, fn)

    async def parse(self, path: str, raw: bytes) -> Request:
        """The parsed, validated request of a body. One with more commas than any request
        within the context holds is refused unparsed (parsing megabytes of token ids holds
        the GIL, and so the event loop: docs/BENCHMARKS.md, "Every request field at its
        bound")."""
        if raw.count(b",") > self.max_commas:
            raise APIError(
                400,
                f"the request holds more values than any request within this model's context "
                f"({self.max_model_len} tokens) takes",
                code="context_length_exceeded",
            )
        return await self._run(
            len(raw) >= INLINE_BYTES, _parse, path, raw, self.ignore_unknown_fields
        )

    async def prompt_ids(self, req: Request) -> list[int]:
        """The prompt's token ids: the chat template applied and encoded, the text encoded, or
        the client's ids (checked against the vocabulary). Raises a 400 when they cannot fit."""
        if isinstance(req, CompletionRequest) and not isinstance(req.prompt, str):
            return self._checked_ids(req.prompt)
        if isinstance(req, ChatCompletionRequest):
            size = _conversation_size(req.messages, req.tools)
            text = await self._run(size >= INLINE_BYTES, self._render, req.messages, req.tools)
            param = "messages"
        else:
            assert isinstance(req.prompt, str)
            text, param = req.prompt, "prompt"
        if len(text) * 4 >= self.max_model_len * self.max_token_bytes:  # (4: the most bytes a
            self._check_fits(len(text.encode()), param)  # character takes in UTF-8)
        return await self._run(len(text) >= INLINE_BYTES, self.tok.encode, text)

    async def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: ToolRequest | None = None,
    ) -> str:
        """A conversation's text under the chat template (off the loop when large)."""
        size = _conversation_size(messages, tools)
        return await self._run(
            size >= INLINE_BYTES, self._render, messages, tools, add_generation_prompt
        )

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """A text's token ids, whatever its length (off the loop when large)."""
        return await self._run(len(text) >= INLINE_BYTES, self.tok.encode, text, add_special_tokens)

    async def decode(self, ids: list[int]) -> str:
        """Token ids' text, special tokens kept (off the loop when many)."""
        return await self._run(len(ids) >= INLINE_BYTES // 4, self.tok.decode, ids, False)

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: ToolRequest | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        # Tools and the history's calls as the template takes them (pd.worker.tools.prompt).
        messages, template_tools = template_inputs(messages, tools, self.template_renders_tools)
        try:
            return self.tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=template_tools
            )
        except Exception as e:  # a template's raise_exception, or a malformed conversation
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None

    def _check_fits(self, nbytes: int, param: str) -> None:
        least = -(-nbytes // self.max_token_bytes)
        if least >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt has at least {least} tokens ({nbytes} bytes, at most "
                f"{self.max_token_bytes} bytes a token) but this model's context length is "
                f"{self.max_model_len}: shorten it",
                code="context_length_exceeded",
                param=param,
            )

    def _checked_ids(self, ids: list[int]) -> list[int]:
        if len(ids) >= self.max_model_len:  # before looking at each id
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but this model's context length is "
                f"{self.max_model_len}: shorten it",
                code="context_length_exceeded",
                param="prompt",
            )
        return checked_token_ids(ids, self.tok.vocab_size, "prompt")


def _conversation_size(messages: list[dict[str, Any]], tools: ToolRequest | None) -> int:
    """About how many characters a conversation renders to: its contents, its calls' JSON and
    the tools' (sizing a JSON costs a small fraction of rendering it: docs/EXPERIMENTS.md
    §23)."""
    size = sum(len(m["content"]) for m in messages)
    size += sum(len(orjson.dumps(m["tool_calls"])) for m in messages if m.get("tool_calls"))
    if tools is not None:
        size += len(orjson.dumps(tools.tools))
    return size


def checked_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    """`ids` when each is in the vocabulary (they are non-negative ints already), else a 400."""
    if ids and max(ids) >= vocab_size:
        bad = next(t for t in ids if t >= vocab_size)
        raise bad_request(
            f"token id {bad} is out of the vocabulary (size {vocab_size})", param=param
        )
    return list(ids)


def _parse(path: str, raw: bytes, ignore_unknown_fields: bool) -> Request:
    return parse_request(path, parse_json_body(raw), ignore_unknown_fields=ignore_unknown_fields)
