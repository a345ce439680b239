"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral), tensor-parallel by SPMD.

One controller holds `tp` rank shards. A rank owns, for every layer, a column-parallel slice of the
fused QKV and gate/up projections (its share of the heads and of the MLP width), the matching
row-parallel slice of the output and down projections, and its own KV buffer. Each rank's partial
sums are reduced by a `Communicator` (a plain sum on one CPU device; NCCL across CUDA devices).
Embeddings, norms and the LM head are replicated. Linear layers are dense or weight-only
quantized (`quant.py`).

Weights arrive in Hugging Face names (see `loader.py`); `shard_weights` maps them onto ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import pd.worker.model.quant as quant
from pd.kvcache.kv_pool import KVPool
from pd.kvcache.paged_metadata import PagedMetadata
from pd.worker.model.attention import AttentionBackend
from pd.worker.model.attention.torch_backend import DecodeInputs, paged_decode_attention
from pd.worker.model.communicator import Communicator
from pd.worker.model.config import ModelConfig
from pd.worker.model.quant import Linear, Weight


class RMSNorm:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim, the variance in fp32 whatever the
    dtype.

    On CPU, torch's `F.rms_norm` is a composite of ~20 ops, slower inside a step than alone, where
    the weights streamed between calls evict torch's own code and data; `layer_norm` is one fused
    kernel but subtracts the mean. The mean of `[x, -x]` is zero and its mean square is x's, so the
    first half of `layer_norm([x, -x])` is x normalized by its RMS (then times the weight, in the
    model's dtype). The weight inside the fused kernel (one rounding, as `F.rms_norm` rounds) is one
    op fewer, but bf16 int4's first token for "What is the capital of France?" is a near tie: that
    form made it an exact tie and the answer "L'Étoile", this one keeps F.rms_norm's logits there
    and "Paris" (docs/EXPERIMENTS.md §8, "RMS norm", with what each form took off a one-row step;
    §23). On CUDA, `F.rms_norm` is fused."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps
        self.fused = weight.device.type != "cpu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        n = x.shape[-1]
        if self.fused:
            return F.rms_norm(x, (n,), self.weight, self.eps)
        y = F.layer_norm(torch.cat([x, -x], dim=-1), (2 * n,), None, None, self.eps)
        return y[:, :n] * self.weight  # [T, hidden], dense


class Rotary:
    """Rotary position embedding, applied to q and k rows laid out in interleaved pairs.

    Hugging Face's rotate-half layout pairs dim i of a head with dim i + D/2; `shard_layer`
    reorders the rows of the Q and K projections so that pairs are adjacent (dims 2i, 2i+1, the
    layout of the original Llama and of GGUF files). Attention only takes dot products of q
    with k, which a permutation of both leaves unchanged, and v is not permuted: the model's
    outputs are the same, and a pair is one complex number, so rotating is one complex multiply
    instead of ten elementwise ops. K is cached in this layout (every worker writes and reads
    it the same way). Rotated in fp32: in bf16 (cos and sin rounded to 8 bits) the int4 model's
    greedy answers changed (e.g. "What is the capital of France?" lost "Paris").
    """

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        inv_freq = _scale_llama3(inv_freq, config.rope_scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [P, dim/2]
        angles = torch.polar(torch.ones_like(freqs), freqs).to(torch.complex64)
        self.cos_sin = torch.view_as_real(angles).to(device)  # [P, dim/2, 2] fp32

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """(cos, sin) [T, 1, D/2, 2] (fp32) of a step's positions [T], looked up once per step:
        e^(i * position * freq) as a complex number's real and imaginary parts."""
        return self.cos_sin[positions].unsqueeze(1)

    @staticmethod
    def apply_(x: torch.Tensor, angles: torch.Tensor) -> None:
        """Rotate x [T, H, D] (a view into the layer's qkv output) in place."""
        t, h, d = x.shape
        if torch.compiler.is_compiling():  # inductor generates no code for complex ops
            cos, sin = angles.unbind(-1)  # [T, 1, D/2]
            even, odd = x.float().reshape(t, h, d // 2, 2).unbind(-1)
            rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
            x.copy_(rotated.view(t, h, d))
            return
        pairs = torch.view_as_complex(x.float().reshape(t, h, d // 2, 2))
        x.copy_(torch.view_as_real(pairs * torch.view_as_complex(angles)).view(t, h, d))


def interleave_pairs(num_heads: int, head_dim: int) -> torch.Tensor:
    """The row order [num_heads * head_dim] that turns a Q or K projection from rotate-half
    (dims i, i + D/2 paired) into interleaved pairs (dims 2i, 2i + 1), for `Rotary`."""
    half = head_dim // 2
    within = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    return (torch.arange(num_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def _scale_llama3(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, scaled)


@dataclass
class LayerShard:
    """One rank's slice of one decoder layer: its linear layers (dense or quantized)."""

    qkv: Linear  # [hidden] -> [(Hq_r + 2*Hkv_r) * D], with the q/k/v biases if any
    o: Linear  # [Hq_r * D] -> [hidden] (partial: summed over ranks)
    gate_up: Linear  # [hidden] -> [2 * I_r]
    down: Linear  # [I_r] -> [hidden] (partial)

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.o.nbytes + self.gate_up.nbytes + self.down.nbytes


@dataclass
class RankState:
    """Everything one TP rank owns."""

    device: torch.device
    layers: list[LayerShard]
    kv: KVPool
    attn: AttentionBackend
    rotary: Rotary
    num_heads: int  # heads of this rank
    num_kv_heads: int


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        ranks: list[RankState],
        embed: torch.Tensor,  # [V, hidden], on ranks[0].device
        norms: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (input, post-attention)
        final_norm: torch.Tensor,
        lm_head: Linear,  # [hidden] -> [V] (the embedding's weights when tied)
        comm: Communicator,
    ) -> None:
        self.config = config
        self.ranks = ranks
        self.embed = embed
        eps = config.rms_norm_eps
        self.norms = [(RMSNorm(a, eps), RMSNorm(b, eps)) for a, b in norms]
        self.final_norm = RMSNorm(final_norm, eps)
        self.lm_head = lm_head
        self.comm = comm
        self.sm_scale = config.head_dim**-0.5
        # `hidden` compiled (torch.compile) for decode steps, when asked: see `compile_decode`;
        # for one-row decode steps only, once a background compile installs it (one_row.py).
        # The LM head runs after it, eagerly (its kernel may be one dynamo cannot trace).
        self.compiled_decode: Callable[..., torch.Tensor] | None = None
        self.compiled_one_row: Callable[..., torch.Tensor] | None = None

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] on ranks[0].device
        meta: PagedMetadata,  # on ranks[0].device
        logits_indices: torch.Tensor,  # [S] rows of T whose next-token logits are wanted
        eager: bool = False,  # not the compiled step (extra rows: the prompt's logprobs)
    ) -> torch.Tensor:  # [S, V] fp32
        attns = [rank.attn for rank in self.ranks]
        angles, kv_rows = self.plan(meta, attns)
        compiled = self.compiled_decode
        if compiled is None and input_ids.shape[0] == 1:
            compiled = self.compiled_one_row
        if compiled is not None and meta.is_decode_only and not eager:
            # At least 2 pages: a size of 1 would be a graph of its own (dynamo specializes it).
            decode = [attn.decode_inputs(min_pages=2) for attn in attns]
            return self.logits(compiled(input_ids, angles, kv_rows, decode, logits_indices))
        return self.layers(input_ids, angles, kv_rows, None, logits_indices)

    def plan(
        self, meta: PagedMetadata, attns: list[AttentionBackend]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Plan the step's attention on `attns` (a backend per rank: the ranks' own, or a
        background compile's private ones); the `layers` arguments that come from `meta`: the
        rotary angles and the K/V rows, per rank."""
        cfg = self.config
        metas = [
            meta if r.device == self.ranks[0].device else meta.to(r.device) for r in self.ranks
        ]
        for rank, attn, m in zip(self.ranks, attns, metas):
            attn.plan(
                m,
                rank.num_heads,
                rank.num_kv_heads,
                cfg.head_dim,
                rank.kv.page_size,
                rank.kv.dtype,
            )
        angles = [rank.rotary.angles(m.positions) for rank, m in zip(self.ranks, metas)]
        kv_rows = [
            rank.kv.rows_of(m.write_page_ids, m.write_offsets) for rank, m in zip(self.ranks, metas)
        ]
        return angles, kv_rows

    def layers(
        self,
        input_ids: torch.Tensor,  # [T]
        angles: list[torch.Tensor],  # per rank: the step's rotary angles
        kv_rows: list[torch.Tensor],  # per rank: where the step's K/V go (`KVPool.rows_of`)
        decode: list[DecodeInputs] | None,  # per rank, a pure decode step's attention inputs
        logits_indices: torch.Tensor,  # [S]
    ) -> torch.Tensor:  # [S, V] fp32
        """Every layer and the LM head, after the step's metadata is planned."""
        return self.logits(self.hidden(input_ids, angles, kv_rows, decode, logits_indices))

    def hidden(
        self,
        input_ids: torch.Tensor,  # [T]
        angles: list[torch.Tensor],
        kv_rows: list[torch.Tensor],
        decode: list[DecodeInputs] | None,
        logits_indices: torch.Tensor,  # [S]
    ) -> torch.Tensor:  # [S, hidden]
        """Every layer and the final norm of the rows in `logits_indices`: the part that
        `compiled_decode.py` compiles for decode steps (no Python reads the metadata's lists
        here); `layers`' arguments."""
        cfg = self.config
        h = self.embed[input_ids]  # [T, hidden]
        for i in range(cfg.num_layers):
            in_norm, post_norm = self.norms[i]
            x = in_norm(h)
            xs = self.comm.broadcast(x)
            partial = [
                self._attention(i, rank, a, rows, None if decode is None else decode[r], xr)
                for r, (rank, a, rows, xr) in enumerate(zip(self.ranks, angles, kv_rows, xs))
            ]
            h = h + self.comm.reduce(partial)
            x = post_norm(h)
            xs = self.comm.broadcast(x)
            partial = [self._mlp(rank.layers[i], xr) for rank, xr in zip(self.ranks, xs)]
            h = h + self.comm.reduce(partial)
        return self.final_norm(h[logits_indices])  # [S, hidden]

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # h [S, hidden] -> [S, V] fp32
        """The LM head, outside any compiled graph: a dynamic int8 head's packed weight is an
        object dynamo does not trace."""
        return self.lm_head(h).float()

    def _attention(
        self,
        i: int,
        rank: RankState,
        angles: torch.Tensor,
        kv_rows: torch.Tensor,
        decode: DecodeInputs | None,
        x: torch.Tensor,
    ) -> torch.Tensor:
        shard = rank.layers[i]
        d, hq, hkv = self.config.head_dim, rank.num_heads, rank.num_kv_heads
        qkv = shard.qkv(x)  # [T, (Hq_r + 2 Hkv_r) * D]: q, k, v side by side
        t = qkv.shape[0]
        # q and k lie side by side, head after head: rotated in one go, in place.
        Rotary.apply_(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), angles)
        rank.kv.write(i, qkv[:, hq * d :].view(t, 2, hkv, d), kv_rows)  # k and v, one op
        q = qkv[:, : hq * d].view(t, hq, d)
        cache = rank.kv.layer_cache(i)
        if decode is None:
            out = rank.attn.forward(q, cache, self.sm_scale)  # [T, Hq_r, D]
        else:
            out = paged_decode_attention(q, cache, decode, self.sm_scale)
        return shard.o(out.reshape(t, hq * d))  # [T, hidden] partial

    @staticmethod
    def _mlp(shard: LayerShard, x: torch.Tensor) -> torch.Tensor:
        gate, up = shard.gate_up(x).chunk(2, dim=-1)  # [T, I_r] each
        return shard.down(F.silu(gate) * up)  # [T, hidden] partial


def check_tp(config: ModelConfig, tp: int) -> None:
    """Refuse a TP size that does not split the model evenly, naming the sizes that would."""
    ok = [
        n
        for n in range(1, config.num_kv_heads + 1)
        if config.num_kv_heads % n == 0
        and config.num_heads % n == 0
        and config.intermediate_size % n == 0
    ]
    if tp not in ok:
        raise ValueError(
            f"--tp {tp} does not divide this model evenly ({config.num_heads} attention heads, "
            f"{config.num_kv_heads} KV heads, MLP width {config.intermediate_size}); "
            f"valid TP sizes: {', '.join(map(str, ok))}"
        )


def shard_layer(
    weights: Mapping[str, Weight],
    config: ModelConfig,
    i: int,
    rank: int,
    tp: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    group_size: int = 32,
    act_max: Mapping[str, torch.Tensor] | None = None,
) -> LayerShard:
    """Cut rank `rank`'s slice of layer `i` out of Hugging Face weights (float, or quantized in
    groups as a GGUF file's Q4_1 are), as `quantization` asks; `act_max`: the calibration's
    largest |input| per channel of each linear layer, whole (smooth_quant.py), or None."""
    p = f"model.layers.{i}."
    d = config.head_dim
    hq, hkv, inter = (
        config.num_heads // tp,
        config.num_kv_heads // tp,
        config.intermediate_size // tp,
    )

    def out_rows(name: str, n: int) -> Weight:  # column-parallel: this rank's outputs
        return quant.rows(weights[p + name], rank * n, (rank + 1) * n)

    def in_cols(name: str, n: int) -> Weight:  # row-parallel: this rank's inputs
        return quant.cols(weights[p + name], rank * n, (rank + 1) * n, quantization, group_size)

    def bias_rows(name: str, n: int) -> torch.Tensor:
        b = weights[p + name]
        assert isinstance(b, torch.Tensor), f"{p + name} must be a float tensor"
        return b[rank * n : (rank + 1) * n]

    q_order, k_order = interleave_pairs(hq, d), interleave_pairs(hkv, d)  # see `Rotary`
    qkv = quant.cat_rows(
        [
            quant.take_rows(out_rows("self_attn.q_proj.weight", hq * d), q_order),
            quant.take_rows(out_rows("self_attn.k_proj.weight", hkv * d), k_order),
            out_rows("self_attn.v_proj.weight", hkv * d),
        ]
    )
    bias = None
    if config.qkv_bias:
        bias = torch.cat(
            [
                bias_rows("self_attn.q_proj.bias", hq * d)[q_order],
                bias_rows("self_attn.k_proj.bias", hkv * d)[k_order],
                bias_rows("self_attn.v_proj.bias", hkv * d),
            ]
        )
    gate_up = quant.cat_rows(
        [out_rows("mlp.gate_proj.weight", inter), out_rows("mlp.up_proj.weight", inter)]
    )

    def linear(kind: str, w: Weight, b: torch.Tensor | None = None, width: int = 0) -> Linear:
        a = None if act_max is None else act_max[kind]
        if a is not None and width:  # row-parallel: this rank's inputs
            a = a[rank * width : (rank + 1) * width]
        return quant.make_linear(w, b, quantization, group_size, dtype, device, a)

    return LayerShard(
        qkv=linear("qkv", qkv, bias),
        o=linear("o", in_cols("self_attn.o_proj.weight", hq * d), None, hq * d),
        gate_up=linear("gate_up", gate_up),
        down=linear("down", in_cols("mlp.down_proj.weight", inter), None, inter),
    )
