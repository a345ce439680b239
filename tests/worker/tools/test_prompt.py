"""Tools and the history's calls in the prompt (no model): arguments as objects for templates that
render tools, pd's default tool prompt for those that do not (the default model's)."""

from __future__ import annotations

import json

import tokenizers

from pd.protocol import parse_request
from pd.worker.api.prompt import PromptBuilder
from pd.worker.text.tokenizer import Tokenizer
from pd.worker.tools.prompt import renders_tools, template_inputs, tool_prompt

# SmolLM2-135M-Instruct's chat template (the default model's, from its GGUF): no tools.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A template that renders tools and reads the calls' arguments as objects (as HF templates do).
WITH_TOOLS = (
    "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}"
    "({{ c.function.arguments.city }}){% endfor %}\n{% endfor %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]  # fmt: skip


def request(messages: list, **body):
    return parse_request("/v1/chat/completions", {"messages": messages, **body})


def render(template: str, messages: list, **body) -> str:
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0}, []))
    req = request(messages, **body)
    builder = PromptBuilder(Tokenizer(backend, chat_template=template), 4096)
    try:
        return builder._render(req.messages, req.tools)
    finally:
        builder.close()


def test_which_templates_render_tools():
    assert not renders_tools(SMOLLM2) and not renders_tools(None)
    assert renders_tools(WITH_TOOLS)
    assert not renders_tools("{{ toolset }}")


def test_a_template_with_tools_gets_them_and_the_arguments_as_objects():
    text = render(WITH_TOOLS, HISTORY, tools=[WEATHER])
    assert text.startswith("TOOLS=" + json.dumps([WEATHER]))
    assert "CALL get_weather(Paris) CALL get_weather(Rome)" in text
    assert "tool: sunnytool: rain" in text  # (trim_blocks eats the newlines)
    req = request(HISTORY)  # the request's own messages are left as they came
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    messages, tools = template_inputs(req.messages, None, True)
    assert tools is None and messages[1]["tool_calls"][1]["function"]["arguments"] == {
        "city": "Rome"
    }


def test_the_default_tool_prompt_for_a_template_without_tools():
    text = render(SMOLLM2, HISTORY, tools=[WEATHER])
    req = request(HISTORY, tools=[WEATHER])
    assert req.tools is not None
    expect = (
        "<|im_start|>system\n" + tool_prompt(req.tools) + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expect
    prompt = tool_prompt(req.tools)
    assert json.dumps(WEATHER) in prompt and "<tool_call>" in prompt and "<tools>" in prompt


def test_the_default_tool_prompt_joins_the_first_system_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = render(SMOLLM2, messages, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1 and "SmolLM" not in text
    # tool_choice none: the tools are still rendered (as vLLM does); no tools: nothing changes.
    assert render(SMOLLM2, messages, tools=[WEATHER], tool_choice="none") == text
    plain = render(SMOLLM2, messages)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
        "<|im_start|>assistant\n"  # fmt: skip


def test_history_calls_render_as_text_without_tools_in_the_request():
    text = render(SMOLLM2, [*HISTORY, {"role": "user", "content": "thanks"}])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}' in text
    assert "<|im_start|>tool" not in text and "# Tools" not in text
    assert text.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")
