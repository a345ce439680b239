"""What the chat template sees of a request's tools and of the history's calls and results.

- The history's `tool_calls[].function.arguments` (JSON strings on the wire) become objects, as
  vLLM does it: Hugging Face templates expect dicts (Llama 3.1's would encode a string twice).
- A template that renders tools (its source mentions `tools`) gets them as the `tools` variable.
- A template that does not (SmolLM2's, the default model's) gets pd's default tool prompt
  instead: a system message (appended to the first system message, or a new one first) listing
  the function schemas and Hermes' call format, `<tool_call>{"name", "arguments"}</tool_call>`;
  the history's calls are written into their assistant messages in that format, and tool results
  become user messages of `<tool_response>` blocks (consecutive results in one), as Qwen2.5's
  template writes them. The model's calls are then parsed as Hermes' (`--tool-call-parser auto`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pd.protocol.tools import ToolRequest

_MENTIONS_TOOLS = re.compile(r"\btools\b")

# Qwen2.5's tool prompt (its chat template's words), which Hermes-format models were tuned on.
TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def renders_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (its source mentions `tools`)."""
    return bool(template) and _MENTIONS_TOOLS.search(template or "") is not None


def tool_prompt(tools: ToolRequest) -> str:
    """The default tool prompt: every function's schema, one JSON line each, and the format."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
    return TOOL_PROMPT.format(tools=lines)


def _call(call: dict[str, Any]) -> dict[str, Any]:
    """A history call with its arguments as an object."""
    fn = call["function"]
    args = fn.get("arguments")
    if isinstance(args, str):
        args = json.loads(args)  # checked by pd.protocol.tools: valid JSON
    return {**call, "function": {**fn, "arguments": args if args is not None else {}}}


def with_argument_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each history call's arguments parsed into an object."""
    return [
        {**m, "tool_calls": [_call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in messages
    ]


def _as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history's calls and results written as text, for a template that knows neither."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            last = out[-1] if out else None
            if last is not None and last.get("_tool_results"):
                last["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if m.get("tool_calls"):
            calls = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for c in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = text
        out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def template_inputs(
    messages: list[dict[str, Any]], tools: ToolRequest | None, template_renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the `tools` variable to render a request's prompt with."""
    has_history = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if tools is None and not has_history:
        return messages, None
    messages = with_argument_objects(messages)
    if template_renders_tools:
        return messages, list(tools.tools) if tools is not None else None
    messages = _as_text(messages)
    if tools is not None:
        prompt = tool_prompt(tools)
        at = next((i for i, m in enumerate(messages) if m["role"] == "system"), None)
        if at is None:
            messages = [{"role": "system", "content": prompt}, *messages]
        else:
            first = messages[at]
            content = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
            messages = [*messages[:at], {**first, "content": content}, *messages[at + 1 :]]
    return messages, None
