"""Our GGUF tokenizer against transformers' own GGUF tokenizer conversion, and the chat template.

NOTE: transformers (5.24) does not know the GGUF pre-tokenizer "smollm" and falls back to plain
GPT-2 splitting. SmolLM2 isolates every digit first (its tokenizer.json: Digits(individual_digits)
+ ByteLevel; llama.cpp: "\\p{N}" then the GPT-2 regex). Whitespace before a digit shows it:
"  3" is [ĠĠ, 3] for SmolLM2 and [Ġ, Ġ, 3] with the fallback. So the reference below splits the
digits off first and lets transformers tokenize each piece; test_digits_split_individually checks
the SmolLM2 behaviour by hand.
"""

from __future__ import annotations

import os

import pytest
import regex

from pd.worker.checkpoint.default_model import default_model_path
from pd.worker.checkpoint.gguf_file import read_gguf_metadata
from pd.worker.checkpoint.gguf_tokenizer import pre_tokenizer_spec, tokenizer_from_gguf_metadata
from pd.worker.checkpoint.load_utils import CheckpointError
from pd.worker.text.tokenizer import ChatTemplateError, Tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "12345 3.14159",
    "  3 apples and 42  pears, 2024-01-31",
    "def f(x):\n    return x ** 2  # square\n",
    "tabs\tand   runs     of spaces\n\n\n",
    "line1\nline2\r\nline3",
    "emoji 😀🎉 and a ZWJ family 👨‍👩‍👧",
    "中文字符和日本語のテキスト、한국어",
    "Crème brûlée, naïve café, Ångström, Ωμέγα",
    "don't you'll we've I'M",
    "½ ² ٣ Ⅻ numerals",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)
_DIGIT = regex.compile(r"(\p{N})")


@pytest.fixture(scope="module")
def meta() -> dict:
    return read_gguf_metadata(default_model_path())


@pytest.fixture(scope="module")
def tok(meta: dict) -> Tokenizer:
    return tokenizer_from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def reference():
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )


def reference_ids(ref, text: str) -> list[int]:
    ids: list[int] = []
    for piece in _DIGIT.split(text):  # digits isolated, as SmolLM2 does (see the module note)
        if piece:
            ids += ref.encode(piece, add_special_tokens=False)
    return ids


def test_basic_facts(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.id_to_token(1) == "<|im_start|>"
    assert tok.eos_token_ids == frozenset({2})  # <|im_end|>: EOS and the template's end of turn
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # add_bos_token false


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok: Tokenizer, reference, text: str) -> None:
    assert tok.encode(text) == reference_ids(reference, text)


def test_chat_prompt_ids_match_transformers(tok: Tokenizer, reference) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 17 * 23? Show  2 steps."},
        {"role": "assistant", "content": "391."},
        {"role": "user", "content": "Thanks! 😀"},
    ]
    prompt = tok.apply_chat_template(messages)
    assert prompt == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tok.encode(prompt) == reference_ids(reference, prompt)


def test_digits_split_individually(tok: Tokenizer) -> None:
    digit = {c: tok.backend.token_to_id(c) for c in "0123456789"}
    assert tok.encode("12345") == [digit[c] for c in "12345"]
    assert tok.encode("  3") == [tok.backend.token_to_id("ĠĠ"), digit["3"]]
    space, dot = tok.backend.token_to_id("Ġ"), tok.backend.token_to_id(".")
    assert tok.encode(" 3.14") == [space, digit["3"], dot, digit["1"], digit["4"]]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    if "<|" not in text:
        assert tok.decode(ids) == text


def test_decode_skips_special_tokens(tok: Tokenizer) -> None:
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_other_pre_tokenizers_match_transformers(meta: dict, pre: str) -> None:
    """The llama.cpp split regexes we carry for other `pre` values, on SmolLM2's vocabulary."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    ours = tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.pre": pre})
    backend, _ = convert_gguf_tokenizer(
        "llama",
        {
            "tokenizer_type": "gpt2",
            "pre_tokenizer_type": pre,
            "tokens": meta["tokenizer.ggml.tokens"],
            "merges": meta["tokenizer.ggml.merges"],
            "token_type": meta["tokenizer.ggml.token_type"],
        },
    )
    for text in TEXTS:  # all NFC already: our qwen2 adds an NFC normalizer, transformers' not
        assert ours.encode(text) == backend.encode(text, add_special_tokens=False).ids, text


def test_unknown_pre_tokenizer_is_refused(meta: dict) -> None:
    with pytest.raises(CheckpointError, match="unsupported GGUF pre-tokenizer"):
        tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(CheckpointError, match="SentencePiece"):
        tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.model": "llama"})
    assert pre_tokenizer_spec("llama-bpe").ignore_merges


# --- chat template ---------------------------------------------------------------------------


def test_chat_template_renders_smollm2_chatml(tok: Tokenizer) -> None:
    user = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(user) == (
        SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(user, add_generation_prompt=False) == (
        SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n"
    )
    with_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(with_system) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_joins_text_parts(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    joined = tok.apply_chat_template([{"role": "user", "content": "a\nb"}])
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == joined
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(ChatTemplateError, match="only text"):
        tok.apply_chat_template([{"role": "user", "content": image}])


def test_large_texts_encode_the_same_without_the_gil(tok: Tokenizer) -> None:
    text = " ".join(TEXTS) * 200  # over the length at which `encode` goes through encode_batch
    assert len(text) > 4096
    assert tok.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", [*TEXTS, "<|im_start|>user\nhi<|im_end|>", "a" * 5000])
def test_byte_length_bounds_the_token_count(tok: Tokenizer, text: str) -> None:
    # What the worker refuses a prompt by before tokenizing it: never more than it holds.
    assert 1 < tok.max_token_bytes < 200
    assert len(tok.encode(text)) >= -(-len(text.encode()) // tok.max_token_bytes)
