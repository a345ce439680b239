"""The tokenizer a worker uses: a `tokenizers.Tokenizer` plus the model's chat template and EOS set.

Built by the loaders (`gguf_tokenizer.py` for a GGUF, `hf_loader.py` for a Hugging Face directory).
The chat template is rendered the way transformers renders it: a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, and
the special tokens (`bos_token`, `eos_token`) as variables.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Tokens that end an assistant turn in common chat templates. One counts as an EOS when it is a
# special token of the vocabulary and the model's chat template writes it.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|END_OF_TURN_TOKEN|>",
    "<|endoftext|>",
)


# Texts at least this long are encoded through `encode_batch` (see `Tokenizer.encode`).
_GIL_FREE_ENCODE_CHARS = 4096


class ChatTemplateError(ValueError):
    """The chat template is missing, fails to render, or raised on purpose (`raise_exception`)."""


class Tokenizer:
    """Text <-> token ids for one model, and its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = self._id_of(bos_token)
        self.eos_token_id: int | None = self._id_of(eos_token)
        eos = set(extra_eos_token_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        for text in END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(text)
            if chat_template and text in chat_template and text in special and token_id is not None:
                eos.add(token_id)
        # EOS plus the chat template's end-of-turn token(s): generation stops on any of them.
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._template: jinja2.Template | None = None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (may be smaller than the model's padded vocab_size)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level spelled, e.g. "Ġhello") or None when out of range."""
        return self.backend.id_to_token(token_id)

    @functools.cached_property
    def token_strings(self) -> list[str | None]:
        """`id_to_token` of every id, as a list (built once: a Python call per id,
        docs/EXPERIMENTS.md §23)."""
        return [self.backend.id_to_token(i) for i in range(self.vocab_size)]

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of a prompt's UTF-8 text one token stands for (added tokens included):
        a text of B bytes has at least B / max_token_bytes tokens, which bounds a prompt before it
        is tokenized. A token's decoded bytes, plus one for a decoder that drops a lone token's
        leading space; where a normalizer rewrites the text first (SentencePiece's "▁" for " "),
        its spelled form too. (A normalizer that deletes characters would break the bound: none
        of the tokenizers we load has one.)"""
        decoded = spelled = 0
        for i in range(self.vocab_size):
            decoded = max(
                decoded, len(self.backend.decode([i], skip_special_tokens=False).encode())
            )
            if self.backend.normalizer is not None:
                spelled = max(spelled, len((self.backend.id_to_token(i) or "").encode()))
        return max(decoded + 1, spelled)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) map to their
        ids; `add_special_tokens` adds what the model adds on its own (a BOS for some models)."""
        if len(text) < _GIL_FREE_ENCODE_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # NOTE: `encode_batch` releases the GIL while it works and `encode` does not (tokenizers
        # 0.23): a large prompt tokenized in a thread then leaves the event loop running.
        batch = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `messages` (OpenAI style; content a string or a list of text
        parts). Raises ChatTemplateError when there is no template or it does not render."""
        if self._template is None:
            if not self.chat_template:
                raise ChatTemplateError("this model has no chat template")
            try:
                self._template = _environment().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"invalid chat template: {e}") from e
        try:
            return self._template.render(
                messages=[_normalize_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e


def _normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with a string content: text parts joined with newlines, None as ""."""
    if not isinstance(message, dict) or "role" not in message:
        raise ChatTemplateError(f"a message must be an object with a role, got {message!r}")
    content = message.get("content")
    if isinstance(content, str):
        return message
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"only text content parts are supported, got {kind!r}")
            texts.append(str(part.get("text", "")))
        return {**message, "content": "\n".join(texts)}
    raise ChatTemplateError(f"message content must be a string or a list of parts, got {content!r}")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant mask): rendered as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
