"""A worker's tool calling: the format its model writes calls in (`--tool-call-parser`), how its
prompts render tools, and per request the `ToolStream` that parses the output.

`auto` reads the format off the chat template: `<tool_call>` is Hermes' (Qwen2.5), `[TOOL_CALLS]`
Mistral's, `<|python_tag|>` or an `ipython` role Llama 3's JSON; a template that renders no tools
gets pd's default tool prompt, which asks for Hermes' format (so does the default model).
"""

from __future__ import annotations

from dataclasses import replace

from pd.config import TOOL_CALL_PARSERS
from pd.protocol import GenerationOptions
from pd.protocol.tools import ToolRequest
from pd.worker.tools.prompt import renders_tools
from pd.worker.tools.segments import segmenter
from pd.worker.tools.stream import ToolStream

PARSERS = TOOL_CALL_PARSERS
# Formats whose markers are special tokens (`<|python_tag|>`, `[TOOL_CALLS]`): the text of an
# output parsed for calls keeps special tokens, as vLLM's parsers ask for it.
_SPECIAL_MARKERS = ("llama3_json", "mistral")


def detect_format(template: str | None) -> str:
    """The tool-call format a chat template's model writes (see the module's docstring)."""
    if not template or not renders_tools(template) or "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


class ToolCalling:
    def __init__(self, chat_template: str | None, parser: str = "auto") -> None:
        if parser not in PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}")
        self.template_renders_tools = renders_tools(chat_template)
        self.format = detect_format(chat_template) if parser == "auto" else parser

    def options(self, options: GenerationOptions, tools: ToolRequest | None) -> GenerationOptions:
        """A request's options as its output's parsing needs them."""
        if tools is not None and tools.choice == "auto" and self.format in _SPECIAL_MARKERS:
            return replace(options, skip_special_tokens=False)
        return options

    def stream(self, tools: ToolRequest | None) -> ToolStream | None:
        """The parser of one request's output; None when it asks for no call."""
        if tools is None or tools.choice == "none":
            return None
        if tools.choice == "function":
            return ToolStream(segmenter("named"), named=tools.name)
        max_calls = None if tools.parallel else 1
        fmt = "array" if tools.choice == "required" else self.format
        return ToolStream(segmenter(fmt), max_calls=max_calls)
