"""Build a `Tokenizer` from a GGUF file's own tokenizer metadata (no tokenizer.json in a GGUF).

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported. The pre-tokenizer follows
`tokenizer.ggml.pre` with llama.cpp's split regexes (llama-vocab.cpp), applied one after another,
each match isolated, then the byte-level mapping; an unknown `pre` is refused rather than
tokenized wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from pd.worker.checkpoint.load_utils import CheckpointError
from pd.worker.text.tokenizer import Tokenizer

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    regexes: tuple[str, ...]  # split in order, each match isolated (llama.cpp unicode_regex_split)
    ignore_merges: bool = False  # a piece that is a whole vocab entry is taken as is (llama 3)
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent
    nfc: bool = False  # Qwen2's tokenizer.json normalizes to NFC


_SPECS = {
    # llama.cpp LLAMA_VOCAB_PRE_TYPE_DEFAULT (also used when `pre` is absent).
    "default": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "gpt2": PreTokenizerSpec((_GPT2,)),
    # Every digit on its own, then GPT-2 (SmolLM's tokenizer.json: Digits(individual) + ByteLevel).
    "digits": PreTokenizerSpec((r"\p{N}", _GPT2)),
    "llama3": PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True),
    "qwen2": PreTokenizerSpec((_QWEN2,), nfc=True),
}
_PRE_FAMILY = {
    "default": "default",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
    "phi-2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "codeshell": "digits",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "pixtral": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "stablelm2": "qwen2",
    "megrez": "qwen2",
}


def pre_tokenizer_spec(pre: str | None) -> PreTokenizerSpec:
    family = _PRE_FAMILY.get(pre or "default")
    if family is None:
        raise CheckpointError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} "
            f"(supported: {', '.join(sorted(_PRE_FAMILY))}); "
            "load the model from a Hugging Face directory with tokenizer.json instead"
        )
    return _SPECS[family]


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any]) -> Tokenizer:
    """A Tokenizer from GGUF metadata (`{key: GGUFReader field .contents()}`)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        raise CheckpointError(
            "GGUF SentencePiece tokenizers (tokenizer.ggml.model='llama') are not supported; "
            "use a byte-level BPE model or a Hugging Face directory with tokenizer.json"
        )
    if kind != "gpt2":
        raise CheckpointError(f"unsupported GGUF tokenizer.ggml.model={kind!r} (supported: gpt2)")
    spec = pre_tokenizer_spec(meta.get("tokenizer.ggml.pre"))
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError("GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab, merges, fuse_unk=False, ignore_merges=spec.ignore_merges)
    )
    if spec.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>) are special: matched whole in text, dropped by
    # decode(skip_special_tokens=True). User-defined ones are matched whole but always decoded.
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens):
        raise CheckpointError("GGUF tokenizer.ggml.token_type and tokens differ in length")
    control = [t for t, k in zip(tokens, types, strict=True) if k == TOKEN_CONTROL]
    user_defined = [t for t, k in zip(tokens, types, strict=True) if k == TOKEN_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", spec.add_bos)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        pre, post = (f"{bos} " if add_bos else ""), (f" {eos}" if add_eos else "")
        added = {t for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None}
        backend.post_processor = processors.TemplateProcessing(
            single=f"{pre}$A{post}",
            pair=f"{pre}$A{post} {pre}$B:1{post}",
            special_tokens=[(t, vocab[t]) for t in sorted(added)],
        )
    extra = [vocab[t] for t in (token("eot_token_id"), token("eom_token_id")) if t is not None]
    return Tokenizer(
        backend,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        extra_eos_token_ids=extra,
    )
