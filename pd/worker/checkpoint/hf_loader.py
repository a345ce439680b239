"""Load a Hugging Face checkpoint directory: config.json, *.safetensors and tokenizer.json, with the
chat template and special tokens from tokenizer_config.json, chat_template.jinja and
generation_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import safe_open

from pd.worker.checkpoint.digest import safetensors_digest
from pd.worker.checkpoint.load_utils import CheckpointError, Progress, check_weights
from pd.worker.model.config import ModelConfig
from pd.worker.text.tokenizer import Tokenizer

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON: {e}") from e


def _rope(cfg: dict[str, Any], where: Path) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and Llama 3 rope scaling, from transformers 4 (rope_theta, rope_scaling) or
    transformers 5 (rope_parameters) config keys."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{where}: rope scaling {kind!r} is not supported (only llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def config_from_hf(path: Path, cfg: dict[str, Any]) -> ModelConfig:
    where = path / "config.json"
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{where}: unsupported architectures {archs} (supported: {sorted(ARCHITECTURES)})"
        )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise CheckpointError(f"{where}: attention_bias / mlp_bias are not supported")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        # Sliding-window attention is not implemented: stay within the window, where it is exact.
        window = cfg.get("sliding_window")
        if window and (arch == "mistral" or cfg.get("use_sliding_window")):
            max_pos = min(max_pos, int(window))
        theta, scaling = _rope(cfg, where)
        return ModelConfig(
            name=path.resolve().name,
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            rope_scaling=scaling,
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: missing key {e}") from e


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def load_hf_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path}: no tokenizer.json (slow tokenizers are not supported)")
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok_cfg = _read_json(path / "tokenizer_config.json")
    cfg = _read_json(path / "config.json")
    gen_cfg = _read_json(path / "generation_config.json")

    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")

    def text_of(token_id: Any) -> str | None:
        ids = _ids(token_id)
        return backend.id_to_token(ids[0]) if ids else None

    bos = _token_text(tok_cfg.get("bos_token")) or text_of(cfg.get("bos_token_id"))
    eos = _token_text(tok_cfg.get("eos_token")) or text_of(cfg.get("eos_token_id"))
    return Tokenizer(
        backend,
        chat_template=template if isinstance(template, str) else None,
        bos_token=bos,
        eos_token=eos,
        extra_eos_token_ids=_ids(gen_cfg.get("eos_token_id")) + _ids(cfg.get("eos_token_id")),
    )


def load_hf(
    path: str, dtype: torch.dtype, progress: bool | None
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, str]:
    """Config, weights, tokenizer and the digest of the shards as stored (see digest.py)."""
    root = Path(path)
    config = config_from_hf(root, _read_json(root / "config.json"))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files (other formats are not supported)")
    tokenizer = load_hf_tokenizer(root)
    digest = safetensors_digest(files)  # from the stored bytes, before any cast

    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            total += len(sf.keys())
    weights: dict[str, torch.Tensor] = {}
    bar = Progress(total, progress)
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                bar.step()
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer some old checkpoints saved; recomputed by the model
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the model uses embed_tokens
                if name in weights:
                    raise CheckpointError(f"{root}: {name} appears in more than one file")
                weights[name] = sf.get_tensor(name).to(dtype)
    bar.close()
    check_weights(weights, config, str(root))
    return config, weights, tokenizer, digest
