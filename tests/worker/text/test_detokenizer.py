import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pd.worker.text.detokenizer import REPLACEMENT, IncrementalDetokenizer

TEXTS = [
    "hello world, the quick brown fox",
    "café naïve résumé Ångström",
    "日本語のテキスト 中文 한국어",
    "emoji 🙂 and family 👨‍👩‍👧 and flag 🇫🇷 ok",
    "mixed: a😀b€c𝄞d",
]
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    # Byte-level BPE with few merges, so most multi-byte characters span several tokens.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 5, trainer=trainer)
    return tok


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


def test_fixture_splits_characters(tokenizer: Tokenizer):
    ids = tokenizer.encode(TEXTS[3]).ids
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids), "no character spans tokens"


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_never_broken_and_concatenation_is_decode(tokenizer: Tokenizer, text: str):
    ids = tokenizer.encode(text).ids
    pieces = _stream(tokenizer, ids)
    assert all(REPLACEMENT not in p for p in pieces), pieces
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert pieces[-1] == ""  # a complete text leaves nothing for flush
    assert sum(1 for p in pieces if p) > 1  # it really streamed


def test_held_back_until_complete(tokenizer: Tokenizer):
    ids = tokenizer.encode("🙂").ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.text == ""
    assert detok.add(ids[-1]) == "🙂"


def test_flush_emits_incomplete_tail(tokenizer: Tokenizer):
    ids = tokenizer.encode("ab🙂").ids[:-1]
    pieces = _stream(tokenizer, ids)
    assert pieces[-1].endswith(REPLACEMENT)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_special_tokens(tokenizer: Tokenizer):
    eos = tokenizer.token_to_id(EOS)
    ids = tokenizer.encode("hi 🙂").ids + [eos]
    assert "".join(_stream(tokenizer, ids)) == "hi 🙂"
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=False)) == "hi 🙂" + EOS


def test_random_ids_match_full_decode(tokenizer: Tokenizer):
    # Arbitrary byte soup (invalid UTF-8 included): the stream must still add up to decode(ids).
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        pieces = _stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids), ids


def test_window_stays_small(tokenizer: Tokenizer):
    class Counting:
        longest = 0

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            Counting.longest = max(Counting.longest, len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(" ".join(TEXTS) * 20).ids
    pieces = _stream(Counting(), ids)  # type: ignore[arg-type]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert Counting.longest <= 10, Counting.longest


def test_invalid_bytes_do_not_grow_the_window(tokenizer: Tokenizer):
    # A lone UTF-8 continuation byte never completes: the stream must not hold it forever.
    lone = next(
        i for i in range(tokenizer.get_vocab_size()) if tokenizer.decode([i, i]) == REPLACEMENT * 2
    )
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(lone) for _ in range(100)]
    assert sum(len(p) for p in pieces) > 50
    assert "".join(pieces) + detok.flush() == REPLACEMENT * 100
