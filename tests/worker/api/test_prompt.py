"""From a parsed request to the engine's input: prompt ids."""

import pytest

from pd.protocol import APIError, parse_request
from pd.worker.api.prompt import INLINE_BYTES, PromptBuilder


class Tok:
    vocab_size = 50
    max_token_bytes = 4
    chat_template = None

    def __init__(self) -> None:
        self.encoded = 0  # characters tokenized

    def encode(self, text: str) -> list[int]:
        self.encoded += len(text)
        return [ord(c) % 50 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool, tools=None) -> str:
        if messages[0]["content"] == "boom":
            raise ValueError("the template refused")
        return "|".join(m["content"] for m in messages) + (">" if add_generation_prompt else "")


def completion(**body):
    return parse_request("/v1/completions", {"prompt": "ab", **body})


def chat(content: str, **body):
    return parse_request(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], **body}
    )


def builder(tok: Tok | None = None, max_model_len: int = 1000) -> PromptBuilder:
    return PromptBuilder(tok or Tok(), max_model_len)  # type: ignore[arg-type]


async def test_prompt_ids_from_text_ids_and_chat():
    tok = Tok()
    b = builder(tok)
    assert await b.prompt_ids(completion()) == tok.encode("ab")
    assert await b.prompt_ids(completion(prompt=[1, 2, 49])) == [1, 2, 49]
    assert await b.prompt_ids(chat("hi")) == tok.encode("hi>")
    b.close()


async def test_bad_prompts_are_400s():
    b = builder()
    with pytest.raises(APIError, match="out of the vocabulary") as e:
        await b.prompt_ids(completion(prompt=[1, 50]))
    assert e.value.status == 400 and e.value.param == "prompt"
    with pytest.raises(APIError, match="the template refused") as e:
        await b.prompt_ids(chat("boom"))
    assert e.value.status == 400 and e.value.param == "messages"
    b.close()


async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized():
    tok = Tok()
    b = builder(tok, max_model_len=100)  # at most 4 bytes a token: 400 bytes are 100+ tokens
    with pytest.raises(APIError, match="at least 100 tokens") as e:
        await b.prompt_ids(completion(prompt="x" * 400))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(APIError, match="at least") as e:
        await b.prompt_ids(chat("é" * 200))  # 2 bytes each: 400 bytes and the template's
    assert e.value.param == "messages"
    assert tok.encoded == 0  # neither was tokenized
    assert len(await b.prompt_ids(completion(prompt="x" * 396))) == 396  # under the bound: on
    with pytest.raises(APIError, match="has 100 tokens"):  # ids: counted before they are read
        await b.prompt_ids(completion(prompt=[1] * 100))
    b.close()


async def test_large_inputs_are_parsed_and_tokenized_off_the_event_loop():
    import threading

    seen: list[str] = []

    class ThreadTok(Tok):
        def encode(self, text: str) -> list[int]:
            seen.append(threading.current_thread().name)
            return super().encode(text)

    b = builder(ThreadTok(), max_model_len=10 * INLINE_BYTES)
    await b.prompt_ids(completion(prompt="small"))
    await b.prompt_ids(completion(prompt="y" * INLINE_BYTES))
    assert seen[0] == threading.current_thread().name and seen[1].startswith("pd-text")
    req = await b.parse("/v1/completions", b'{"prompt": "%s"}' % (b"z" * INLINE_BYTES))
    assert req.prompt == "z" * INLINE_BYTES
    b.close()

