"""Load a GGUF file: config from `{arch}.*` metadata, every tensor dequantized, Hugging Face names.

llama.cpp's converter permutes the rows of Q and K for the llama architecture (its rotary kernel
pairs adjacent dims; Hugging Face's rotate-half pairs dim i with i + head_dim/2). We undo it, so
the weights are exactly the Hugging Face checkpoint's (up to quantization).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pd.worker.checkpoint.digest import gguf_digest
from pd.worker.checkpoint.gguf_file import GGUFTensor, dequantize, read_gguf, read_gguf_metadata
from pd.worker.checkpoint.gguf_tokenizer import tokenizer_from_gguf_metadata
from pd.worker.checkpoint.load_utils import CheckpointError, Progress, check_weights
from pd.worker.model.config import ModelConfig
from pd.worker.model.quant import GroupQuant, Weight
from pd.worker.text.tokenizer import Tokenizer

# Architectures we load, and whether llama.cpp permuted their Q/K rows.
PERMUTED_QK = {"llama": True, "qwen2": False}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|B?F16|F32|FP16|FP32)$", re.IGNORECASE)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute(w, n_head)`: rows per head go from interleaved pairs
    (d0, d_half, d1, d_half+1, ...) back to Hugging Face's two halves. Works for biases too."""
    rest = w.shape[1:]
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def model_name(path: str, meta: dict[str, Any]) -> str:
    """A served name: the file stem without its quantization suffix (the name people gave the
    file, e.g. "SmolLM2-135M-Instruct"), else the GGUF's general.* naming."""
    stem = _QUANT_SUFFIX.sub("", Path(path).name.removesuffix(".gguf"))
    if stem and not re.fullmatch(r"(ggml[-_])?model(-\w+)?", stem, re.IGNORECASE):
        return stem
    basename, size = meta.get("general.basename"), meta.get("general.size_label")
    if basename and size:
        return f"{basename}-{size}"
    return meta.get("general.name") or stem or "model"


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def config_from_metadata(
    path: str, meta: dict[str, Any], tensors: dict[str, GGUFTensor]
) -> ModelConfig:
    """ModelConfig from `{arch}.*` keys; `tensors` maps GGUF names to the file's tensors."""
    arch = meta.get("general.architecture")
    if arch not in PERMUTED_QK:
        raise CheckpointError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {sorted(PERMUTED_QK)})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise CheckpointError(f"{path}: partial rotary ({rot} of {head_dim} dims) is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        raise CheckpointError(f"{path}: rope scaling {scaling_type!r} is not supported")
    rope_scaling = None
    if "rope_freqs.weight" in tensors:
        factors = dequantize(tensors["rope_freqs.weight"]).double().numpy().reshape(-1)
        theta = _f32(key("rope.freq_base", 10000.0))
        rope_scaling = llama3_scaling_from_factors(factors, theta, head_dim)
    return ModelConfig(
        name=model_name(path, meta),
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=_f32(key("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=rope_scaling,
    )


def llama3_rope_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores in rope_freqs.weight for Llama 3 rope scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def llama3_scaling_from_factors(
    factors: np.ndarray, theta: float, head_dim: int
) -> dict[str, Any] | None:
    """Recover Llama 3 rope scaling from rope_freqs.weight by trying the published settings;
    refuse what none of them reproduces (rather than run with wrong positions)."""
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    for old in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0), (0.5, 4.0)):
            scaling = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": old,
            }
            if np.allclose(llama3_rope_factors(scaling, theta, head_dim), factors, rtol=1e-4):
                return scaling
    raise CheckpointError(
        "rope_freqs.weight matches no Llama 3 rope scaling we know; this GGUF is not supported"
    )


def q4_1_groups(raw: np.ndarray, rows: int, cols: int) -> GroupQuant:
    """A Q4_1 tensor's blocks as they are (no float round trip): per 32 weights an fp16 scale
    `d`, an fp16 minimum `m` and 16 bytes of nibbles (weight j low, weight j + 16 high), for
    `w = q * d + m`."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows * (cols // 32), 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, cols // 32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, cols // 32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(rows, cols)
    return GroupQuant(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))


def load_gguf(
    path: str, dtype: torch.dtype, progress: bool | None, keep_q4_1: bool = False
) -> tuple[ModelConfig, dict[str, Weight], Tokenizer, str]:
    """Config, weights, tokenizer and the digest of the file as stored (see digest.py)."""
    if re.search(r"-\d{5}-of-\d{5}\.gguf$", path):
        raise CheckpointError(f"{path}: split GGUF files are not supported; merge them first")
    gguf = read_gguf(path)
    meta, tensors = gguf.metadata, gguf.tensors
    config = config_from_metadata(path, meta, tensors)
    tokenizer = tokenizer_from_gguf_metadata(meta)
    permuted = PERMUTED_QK[config.architecture]
    digest = gguf_digest(gguf)  # from the stored bytes, before any dequantization or cast

    weights: dict[str, Weight] = {}
    bar = Progress(len(tensors), progress)
    for name, t in tensors.items():
        bar.step()
        if name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        target = hf_name(name)
        if target is None:
            raise CheckpointError(f"{path}: unsupported tensor {name!r} ({config.architecture})")
        if keep_q4_1 and t.tensor_type == GGMLQuantizationType.Q4_1 and "_proj." in target:
            g = q4_1_groups(t.data, *t.rows_cols)
            if permuted and (".attn_q." in name or ".attn_k." in name):
                heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
                g = GroupQuant(*(unpermute_qk(x, heads) for x in (g.q, g.scale, g.low)))
            weights[target] = g
            continue
        w = dequantize(t)  # GGUF's shape reversed: [out, in] for a Linear, as in HF
        if permuted and ".attn_q." in name:
            w = unpermute_qk(w, config.num_heads)
        elif permuted and ".attn_k." in name:
            w = unpermute_qk(w, config.num_kv_heads)
        weights[target] = w.to(dtype)
    bar.close()
    check_weights(weights, config, path)
    return config, weights, tokenizer, digest


def load_gguf_tokenizer(path: str) -> Tokenizer:
    """Only the tokenizer: the header read straight through, no tensor mapped (gguf_file.py)."""
    return tokenizer_from_gguf_metadata(read_gguf_metadata(path))
