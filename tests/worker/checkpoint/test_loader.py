"""The default GGUF loads with the right config and exactly transformers' weights; an HF directory
written from it loads back identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pd.worker.checkpoint.default_model import default_model_path
from pd.worker.checkpoint.loader import LoadedCheckpoint, load_checkpoint, load_tokenizer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

TEXTS = ["Hello, world! 12345", "<|im_start|>user\nhi<|im_end|>", "  code(x)\n\tcafé 😀 中文"]


@pytest.fixture(scope="module")
def ckpt() -> LoadedCheckpoint:
    return load_checkpoint(default_model_path())


@pytest.fixture(scope="module")
def reference() -> dict:
    """transformers' own GGUF loading: dequantized, Q/K un-permuted, HF names."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):  # only its parameter names are used, to map GGUF names
        model = transformers.LlamaForCausalLM(cfg)
    # (from_pretrained(gguf_file=...) calls this too, but also wants `accelerate`.)
    return load_gguf_checkpoint(default_model_path(), return_tensors=True, model_to_load=model)


def test_default_config(ckpt: LoadedCheckpoint) -> None:
    c = ckpt.config
    assert c.name == "SmolLM2-135M-Instruct"
    assert c.architecture == "llama"
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and not c.qkv_bias
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert "lm_head.weight" not in ckpt.weights
    assert all(w.dtype == torch.float32 for w in ckpt.weights.values())


def test_config_matches_transformers(ckpt: LoadedCheckpoint, reference: dict) -> None:
    r, c = reference["config"], ckpt.config
    assert r["num_hidden_layers"] == c.num_layers and r["hidden_size"] == c.hidden_size
    assert r["num_attention_heads"] == c.num_heads
    assert r["num_key_value_heads"] == c.num_kv_heads
    assert r["intermediate_size"] == c.intermediate_size
    assert r["rope_theta"] == pytest.approx(c.rope_theta)
    assert r["rms_norm_eps"] == pytest.approx(c.rms_norm_eps)
    assert r["max_position_embeddings"] == c.max_position_embeddings
    assert r["tie_word_embeddings"] == c.tie_word_embeddings


def test_weights_match_transformers(ckpt: LoadedCheckpoint, reference: dict) -> None:
    ref = reference["tensors"]
    assert set(ref) == set(ckpt.weights)
    for name, expected in ref.items():
        ours = ckpt.weights[name]
        assert ours.shape == expected.shape, name
        diff = (ours - expected.float()).abs().max().item()
        assert diff <= 1e-6, f"{name}: max |ours - transformers| = {diff}"
    # The check has teeth: without the un-permute, q_proj would differ.
    q = ckpt.weights["model.layers.0.self_attn.q_proj.weight"]
    permuted = q.reshape(9, 2, 32, 576).transpose(1, 2).reshape(q.shape)
    assert not torch.allclose(permuted, ref["model.layers.0.self_attn.q_proj.weight"])


def test_hf_directory_round_trip(ckpt: LoadedCheckpoint, tmp_path: Path) -> None:
    c, tok = ckpt.config, ckpt.tokenizer
    d = tmp_path / "SmolLM2-135M-Instruct"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in ckpt.weights.items()}, d / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    (d / "config.json").write_text(json.dumps(config))
    tok.backend.save(str(d / "tokenizer.json"))
    tok_config = {"chat_template": tok.chat_template, "bos_token": tok.bos_token,
                  "eos_token": {"content": tok.eos_token, "special": True}}  # fmt: skip
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config))

    back = load_checkpoint(str(d))
    assert back.config == c
    assert back.weights.keys() == ckpt.weights.keys()
    assert all(torch.equal(back.weights[k], w) for k, w in ckpt.weights.items())
    messages = [{"role": "user", "content": "hi 42"}]
    for t in (back.tokenizer, load_tokenizer(str(d))):
        assert t.apply_chat_template(messages) == tok.apply_chat_template(messages)
        assert t.eos_token_ids == tok.eos_token_ids and t.bos_token_id == tok.bos_token_id
        for text in [*TEXTS, tok.apply_chat_template(messages)]:
            assert t.encode(text) == tok.encode(text)
            assert t.decode(t.encode(text)) == tok.decode(tok.encode(text))
