"""How long one step of a batch takes on a simulated device: a roofline per layer, or a measured
table. Shared by the simulated worker (`pd-worker --simulate`), the simulated transfer and the
planner's discrete-event model (`pd-bench plan`), so all three agree on every cost.

A step is its rows: each row is `(num_cached, num_new)`, the tokens already in the request's KV
and the tokens computed this step (a decode row has num_new 1; a prefill chunk more), and a
row samples or not. Per layer, on one TP rank:

- the matmuls (QKV, O, MLP) take max(FLOPs / achieved FLOP/s, weight bytes / achieved bandwidth)
  for all the step's tokens together: weights are read once a step, whatever the batch;
- attention takes max(FLOPs / achieved FLOP/s, KV bytes / achieved bandwidth), its FLOPs causal
  over each row's context, its bytes every row's KV read once;
- with TP > 1, two all-reduces of the step's activations over the interconnect (ring: 2 (tp-1)/tp
  of the bytes each way).

The LM head reads its weights once and computes the sampled rows; a fixed `step_overhead_s` is
added once (launches, scheduling, sampling). The achieved rates are the datasheet peaks times the
device's efficiency factors (calibrated against published figures: docs/simulation.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from pd.sim.profile import Profile

Row = tuple[int, int]  # (num_cached, num_new)


@dataclass(frozen=True)
class StepCost:
    """One step's modeled time and its parts (seconds)."""

    total_s: float
    linear_s: float = 0.0
    attention_s: float = 0.0
    allreduce_s: float = 0.0
    head_s: float = 0.0
    overhead_s: float = 0.0


class CostModel:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        m, d, tp = profile.model, profile.device, profile.tp
        self._flops = d.peak_flops * d.compute_efficiency  # achieved, one GPU
        self._bw = d.hbm_bandwidth * d.memory_efficiency
        self._tp = tp
        self._layers = m.num_layers
        self._layer_weight_bytes = m.layer_linear_params * m.dtype_bytes / tp
        self._layer_linear_flops_per_token = 2 * m.layer_linear_params / tp
        self._heads = m.num_heads / tp
        self._head_dim = m.head_dim
        # KV bytes of one token in one layer on one rank (KV heads replicate past tp = heads).
        self._kv_layer_bytes = 2 * max(1.0, m.num_kv_heads / tp) * m.head_dim * m.dtype_bytes
        self._act_bytes_per_token = m.hidden_size * m.dtype_bytes
        self._head_bytes = m.vocab_size * m.hidden_size * m.dtype_bytes / tp
        self._head_flops_per_row = 2 * m.vocab_size * m.hidden_size / tp
        self._ar_bw = d.interconnect_bandwidth
        self._overhead = d.step_overhead_s
        self._prefill = sorted(profile.prefill_table)
        self._decode = sorted(profile.decode_table)

    def step(self, rows: Sequence[Row], sampled: int | None = None) -> StepCost:
        """The modeled time of one step; `sampled`: rows that sample (default: every row)."""
        if not rows:
            return StepCost(0.0)
        if self._prefill:
            return StepCost(self._from_table(rows))
        tokens = 0
        attn_flops = 0.0
        kv_tokens = 0
        for cached, new in rows:
            tokens += new
            # Each new token attends to the cached ones and to the new ones before it.
            attn_flops += 4 * self._heads * self._head_dim * new * (cached + (new + 1) / 2)
            kv_tokens += cached + new
        sampled = len(rows) if sampled is None else sampled
        linear, attention, allreduce, head = self._roofline(tokens, attn_flops, kv_tokens, sampled)
        n = self._layers
        total = n * (linear + attention + allreduce) + head + self._overhead
        return StepCost(total, n * linear, n * attention, n * allreduce, head, self._overhead)

    def batch_s(
        self,
        decode_rows: int,
        decode_context: int,
        chunks: Sequence[Row] = (),
        sampled: int | None = None,
    ) -> float:
        """`step_s` of `decode_rows` decode rows `(c_i, 1)` with `sum(c_i) == decode_context`
        plus the prefill `chunks`, in time independent of `decode_rows`: a decode row's cost is
        linear in its context, so their sum is all that counts (the planner's DES steps)."""
        rows = decode_rows + len(chunks)
        if not rows:
            return 0.0
        sampled = rows if sampled is None else sampled
        if self._prefill:
            prefill = sum(n for _, n in chunks if n > 1)
            ones = [c for c, n in chunks if n == 1]
            return self._table(prefill, decode_rows + len(ones), decode_context + sum(ones))
        tokens = decode_rows
        # (c, 1): 4 h d (c + 1) FLOPs and c + 1 tokens of KV read, summed over the rows.
        attn_flops = 4 * self._heads * self._head_dim * float(decode_context + decode_rows)
        kv_tokens = decode_context + decode_rows
        for cached, new in chunks:
            tokens += new
            attn_flops += 4 * self._heads * self._head_dim * new * (cached + (new + 1) / 2)
            kv_tokens += cached + new
        linear, attention, allreduce, head = self._roofline(tokens, attn_flops, kv_tokens, sampled)
        return self._layers * (linear + attention + allreduce) + head + self._overhead

    def _roofline(
        self, tokens: int, attn_flops: float, kv_tokens: int, sampled: int
    ) -> tuple[float, float, float, float]:
        """One layer's matmuls, attention and all-reduces, and the LM head (seconds)."""
        linear = max(
            tokens * self._layer_linear_flops_per_token / self._flops,
            self._layer_weight_bytes / self._bw,
        )
        attention = max(attn_flops / self._flops, kv_tokens * self._kv_layer_bytes / self._bw)
        allreduce = 0.0
        if self._tp > 1:
            nbytes = tokens * self._act_bytes_per_token
            allreduce = 2 * (2 * (self._tp - 1) / self._tp * nbytes / self._ar_bw + 5e-6)
        head = max(sampled * self._head_flops_per_row / self._flops, self._head_bytes / self._bw)
        return linear, attention, allreduce, head

    def step_s(self, rows: Sequence[Row], sampled: int | None = None) -> float:
        return self.step(rows, sampled).total_s

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        """One request's whole prefill in one step (what TTFT costs with nothing else running)."""
        return self.step_s([(cached, tokens)], 1)

    def decode_s(self, batch: int, context: int) -> float:
        """One decode step of `batch` rows of `context` tokens each (the ITL of that batch)."""
        return self.step_s([(context, 1)] * batch)

    def kv_transfer_s(self, tokens: int) -> float:
        """A pull of `tokens` tokens of KV between two workers of this profile over its link."""
        link = self.profile.link
        if link is None:
            return 0.0
        return link.transfer_s(tokens * self.profile.model.kv_bytes_per_token, self._tp)

    def _from_table(self, rows: Sequence[Row]) -> float:
        prefill = sum(n for _, n in rows if n > 1)
        decode = [c for c, n in rows if n == 1]
        return self._table(prefill, len(decode), sum(decode))

    def _table(self, prefill: int, decode_rows: int, decode_context: int) -> float:
        """A measured profile: prefill tokens and decode rows (at their mean context) looked up
        apart, then added (the step overhead, inside both figures, counted once)."""
        t = 0.0
        if prefill:
            t += _interp(self._prefill, prefill)
        if decode_rows:
            t += _interp_decode(self._decode, decode_rows, decode_context / decode_rows)
        if prefill and decode_rows:
            t -= min(self._overhead, t / 2)
        return t


def _interp(table: list[tuple[int, float]], x: float) -> float:
    """Piecewise-linear through the points, extrapolated from the nearest two at either end."""
    if len(table) == 1:
        return table[0][1] * x / max(1, table[0][0])
    xs = [p[0] for p in table]
    i = min(max(bisect.bisect_left(xs, x), 1), len(table) - 1)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _interp_decode(table: list[tuple[int, int, float]], rows: int, context: float) -> float:
    """Over rows at each measured context, then over context between the two nearest."""
    by_ctx: dict[int, list[tuple[int, float]]] = {}
    for r, c, s in table:
        by_ctx.setdefault(c, []).append((r, s))
    ctxs = sorted(by_ctx)
    points = [(c, _interp(sorted(by_ctx[c]), rows)) for c in ctxs]
    if len(points) == 1:
        return points[0][1]
    return _interp([(int(c), y) for c, y in points], context)
