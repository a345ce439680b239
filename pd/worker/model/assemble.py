"""The model built from its weights, by one call (`build_model`): each TP rank's layer shards,
KV pool, attention backend and rotary table, the embedding, norms and LM head, and the
communicator between the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pd.kvcache.kv_pool import KVPool
from pd.worker.model.attention import select_attention_backend
from pd.worker.model.communicator import make_communicator
from pd.worker.model.config import ModelConfig
from pd.worker.model.llama import LlamaModel, RankState, Rotary, shard_layer
from pd.worker.model.quant import GroupQuant, Weight, make_linear
from pd.worker.model.runner_config import RunnerConfig
from pd.worker.model.smooth_quant import ActivationMaxima


def lm_head_weight(
    config: ModelConfig, weights: Mapping[str, Weight], dtype: torch.dtype
) -> torch.Tensor:
    """The LM head's weights [V, hidden] as the runner builds its head from them: dense, in the
    compute dtype (the embedding's when tied)."""
    w = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return (w.dequantize() if isinstance(w, GroupQuant) else w).to(dtype)


def build_model(
    config: ModelConfig,
    weights: Mapping[str, Weight],
    rc: RunnerConfig,
    act_maxima: ActivationMaxima | None = None,
) -> LlamaModel:
    """The model of `rc` (checked: `RunnerConfig.checked`) from `weights`."""
    devices = rc.devices()
    ranks = [_rank(config, weights, rc, r, dev, act_maxima) for r, dev in enumerate(devices)]

    def dense(name: str) -> torch.Tensor:
        w = weights[name]
        w = w.dequantize() if isinstance(w, GroupQuant) else w
        return w.to(device=devices[0], dtype=rc.dtype)

    embed = dense("model.embed_tokens.weight")
    head = embed if config.tie_word_embeddings else lm_head_weight(config, weights, rc.dtype)
    # The LM head is the largest matrix a step reads: in its own format (its rule's, or
    # --lm-head-quantization's, or the search's); the embedding's lookup reads a row per token:
    # it stays dense.
    fmt = rc.lm_head_quantization
    lm_head = make_linear(head, None, fmt, rc.group_size, rc.dtype, devices[0])
    norms = [
        (
            dense(f"model.layers.{i}.input_layernorm.weight"),
            dense(f"model.layers.{i}.post_attention_layernorm.weight"),
        )
        for i in range(config.num_layers)
    ]
    final_norm = dense("model.norm.weight")
    return LlamaModel(config, ranks, embed, norms, final_norm, lm_head, make_communicator(devices))


def _rank(
    config: ModelConfig,
    weights: Mapping[str, Weight],
    rc: RunnerConfig,
    r: int,
    dev: torch.device,
    act_maxima: ActivationMaxima | None,
) -> RankState:
    """TP rank `r`'s layer shards, KV pool, attention backend and rotary table."""
    layers = []
    for i in range(config.num_layers):
        act_max = None if act_maxima is None else act_maxima.at(i)
        args = (rc.dtype, dev, rc.quantization, rc.group_size, act_max)
        layers.append(shard_layer(weights, config, i, r, rc.tp, *args))
    kv_heads = config.num_kv_heads // rc.tp
    return RankState(
        device=dev,
        layers=layers,
        kv=KVPool(
            rc.pool_pages, config.num_layers, kv_heads, rc.page_size, config.head_dim, rc.dtype, dev
        ),
        attn=select_attention_backend(dev, rc.dtype, rc.attention_backend, rc.deterministic),
        rotary=Rotary(config, rc.max_model_len, dev),
        num_heads=config.num_heads // rc.tp,
        num_kv_heads=kv_heads,
    )
