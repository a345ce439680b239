"""From a parsed request to the engine's input: prompt ids and the remote-decode flag."""

import pytest

from pd.protocol import APIError, parse_request
from pd.worker.api.prompt import prompt_ids, wants_remote_decode


class Tok:
    vocab_size = 50

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool) -> str:
        if messages[0]["content"] == "boom":
            raise ValueError("the template refused")
        return "|".join(m["content"] for m in messages) + (">" if add_generation_prompt else "")


def completion(**body):
    return parse_request("/v1/completions", {"prompt": "ab", **body})


def chat(content: str, **body):
    return parse_request(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], **body}
    )


def test_prompt_ids_from_text_ids_and_chat():
    tok = Tok()
    assert prompt_ids(tok, completion()) == tok.encode("ab")
    assert prompt_ids(tok, completion(prompt=[1, 2, 49])) == [1, 2, 49]
    assert prompt_ids(tok, chat("hi")) == tok.encode("hi>")


def test_bad_prompts_are_400s():
    with pytest.raises(APIError, match="out of the vocabulary") as e:
        prompt_ids(Tok(), completion(prompt=[1, 50]))
    assert e.value.status == 400 and e.value.param == "prompt"
    with pytest.raises(APIError, match="the template refused") as e:
        prompt_ids(Tok(), chat("boom"))
    assert e.value.status == 400 and e.value.param == "messages"


def test_remote_decode_only_on_prefill_without_streaming():
    asked = {"kv_transfer_params": {"do_remote_decode": True}}
    assert wants_remote_decode("prefill", completion(**asked)) is True
    assert wants_remote_decode("prefill", completion()) is False
    assert wants_remote_decode("both", completion()) is False
    for role, body in [
        ("both", asked),
        ("prefill", {"kv_transfer_params": {"do_remote_decode": "yes"}}),
        ("prefill", {**asked, "stream": True}),
    ]:
        with pytest.raises(APIError) as e:
            wants_remote_decode(role, completion(**body))
        assert e.value.status == 400
