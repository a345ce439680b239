"""The chat template environment (no model needed): variables, filters, tags and errors."""

from __future__ import annotations

import pytest
import tokenizers

from pd.worker.text.tokenizer import ChatTemplateError, Tokenizer


def _tiny(template: str | None) -> Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0, "<s>": 1, "</s>": 2}, []))
    return Tokenizer(backend, chat_template=template, bos_token="<s>", eos_token="</s>")


def test_chat_template_environment() -> None:
    t = _tiny(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}{{ eos_token }}"
        "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% if add_generation_prompt %}{% generation %}A:{% endgeneration %}{% endif %}"
    )
    out = t.apply_chat_template([{"role": "user", "content": "é"}], tools=[{"name": "ü"}])
    assert out == '<s>user:é</s>[{"name": "ü"}]A:'
    assert len(_tiny("{{ strftime_now('%Y') }}").apply_chat_template([])) == 4
    with pytest.raises(ChatTemplateError, match="nope"):
        _tiny("{{ raise_exception('nope') }}").apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _tiny(None).apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        _tiny("{% if %}").apply_chat_template([])
