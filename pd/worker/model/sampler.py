"""Turn a batch of last-position logits into next tokens.

Order per row: logit_bias -> the allowed-token mask (structured outputs, min_tokens,
allowed_token_ids, bad_words: `masks`, one bitmask row per sampled row) -> penalties (repetition,
then frequency/presence) -> logprobs -> greedy argmax, or temperature -> top-k -> softmax (fp32)
-> top-p -> min-p -> inverse-CDF draw with one uniform u per row (the token where u falls in the
cumulative mass). A masked token's logit is -inf before anything else reads it, so every path
(greedy, truncated, seeded) draws only allowed tokens.

Logprobs convention: reported logprobs are log_softmax of the logits AFTER bias, mask and
penalties and BEFORE temperature and top-k/top-p/min-p truncation, in fp32. Without them they are
the raw model logprobs (what OpenAI and vLLM report by default).

Seeded rows: u is a 53-bit hash of (seed, output position) alone, where the output position is
len(output_ids[row]), the index of the token being generated (0 for the first). The same request
therefore samples the same tokens on one worker or on a prefill/decode pair (P samples position 0,
D positions 1..), whatever else is in the batch; on D, output_ids must include the token P sampled.
Every step of a row is a per-row function of that row's logits, so batch composition does not
change it. Unseeded rows draw u from the sampler's own generator.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from math import inf

import torch

from pd.protocol import GenerationOptions
from pd.worker.model.prompt_logprobs import PromptLogprob

TOP_P_CANDIDATES = 1024


@dataclass
class SampleOutput:
    token_ids: list[int]
    # Per row, aligned with token_ids; None where the row did not ask for logprobs.
    logprobs: list[float | None] = field(default_factory=list)
    # Per row: the top_logprobs most likely (token id, logprob), most likely first; [] when the row
    # asked for logprobs but top_logprobs=0; None when it did not ask.
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # The step's prompt logprobs (prompt_logprobs.py): (index of the request in the batch, the
    # prompt position of the first entry, one entry per position from there), for the requests
    # that asked whose prompt this step computed (rows of sampled or not).
    prompt_logprobs: list[tuple[int, int, list[PromptLogprob]]] = field(default_factory=list)


def uniform_for_position(seed: int, position: int) -> float:
    """A uniform in [0, 1) derived only from (request seed, output position)."""
    digest = hashlib.blake2b(f"{int(seed)}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # The stream of unseeded rows (a few uniforms per step, drawn on CPU); None = from entropy.
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,  # [B, V], any float dtype; not modified
        params: list[GenerationOptions],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        masks: torch.Tensor | None = None,  # [B, ceil(V / 32)] int32 allowed-token bitmasks
    ) -> SampleOutput:
        B = logits.shape[0]
        assert len(params) == len(prompt_ids) == len(output_ids) == B, "batch size mismatch"

        biased = [i for i, p in enumerate(params) if p.logit_bias]
        penalized = [i for i, p in enumerate(params) if p.uses_penalties]
        if biased or masks is not None or penalized:
            logits = logits.to(torch.float32, copy=True)  # [B, V]
        if biased:
            _apply_bias(logits, biased, params)
        if masks is not None:
            logits.masked_fill_(~unpack_bitmask(masks.to(logits.device), logits.shape[1]), -inf)
        if penalized:
            _apply_penalties(logits, penalized, params, prompt_ids, output_ids)

        token_ids = [0] * B
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        # NOTE: max(dim).indices, not argmax: the same first index of the largest value, and
        # faster on CPU (docs/BENCHMARKS.md, "Sampling").
        if len(greedy) == B:
            token_ids = logits.max(dim=-1).indices.tolist()
        else:
            if greedy:
                idx = torch.tensor(greedy, device=logits.device)
                for i, t in zip(greedy, logits[idx].max(dim=-1).indices.tolist()):
                    token_ids[i] = t
            sampled = [i for i, p in enumerate(params) if not p.is_greedy]
            chosen = self._sample_rows(logits, sampled, params, output_ids)
            for i, t in zip(sampled, chosen):
                token_ids[i] = t

        out = SampleOutput(token_ids=token_ids, logprobs=[None] * B, top_logprobs=[None] * B)
        wanting = [i for i, p in enumerate(params) if p.wants_logprobs]
        if wanting:
            _fill_logprobs(out, logits, wanting, params)
        return out

    def _sample_rows(
        self,
        logits: torch.Tensor,  # [B, V]
        rows: list[int],
        params: list[GenerationOptions],
        output_ids: list[list[int]],
    ) -> list[int]:
        dev = logits.device
        ps = [params[i] for i in rows]
        idx = torch.tensor(rows, device=dev)
        temps = torch.tensor([p.temperature for p in ps], device=dev)
        u = [0.0] * len(ps)  # one uniform in [0, 1) per row
        unseeded = [j for j, p in enumerate(ps) if p.seed is None]
        if unseeded:
            draws = torch.rand(len(unseeded), dtype=torch.float64, generator=self._generator)
            for j, v in zip(unseeded, draws.tolist()):
                u[j] = v
        for j, p in enumerate(ps):
            if p.seed is not None:
                u[j] = uniform_for_position(p.seed, len(output_ids[rows[j]]))
        u_t = torch.tensor(u, dtype=torch.float64, device=dev)

        ks = [max(0, p.top_k) for p in ps]
        top_ps = [p.top_p for p in ps]
        min_ps = [p.min_p for p in ps]
        rows_logits = logits[idx]  # [R, V]
        fast = _truncated_draw(rows_logits, temps, ks, top_ps, min_ps, u_t)
        if fast is not None:
            return fast
        x = rows_logits.float() / temps[:, None]  # [R, V] fp32
        if any(ks):
            _top_k(x, ks)
        probs = torch.softmax(x, dim=-1)  # [R, V]; truncation below zeroes entries in place
        if any(p < 1.0 for p in top_ps):
            _top_p(probs, top_ps)
        if any(m > 0.0 for m in min_ps):
            min_p = torch.tensor(min_ps, device=dev)[:, None]
            probs.masked_fill_(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        return _inverse_cdf(probs, u_t)


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmasks (bit i of word w: token 32 w + i) -> [R, vocab_size] bool."""
    bits = _BITS.to(masks.device)
    allowed = ((masks.unsqueeze(-1) >> bits) & 1).bool().reshape(masks.shape[0], -1)
    return allowed[:, :vocab_size]


def _apply_bias(logits: torch.Tensor, rows: list[int], params: list[GenerationOptions]) -> None:
    """OpenAI's logit_bias: added to the logits of the named token ids (ids past V ignored)."""
    V = logits.shape[1]
    for i in rows:
        pairs = [(t, b) for t, b in params[i].logit_bias if t < V]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], device=logits.device)
            bias = torch.tensor([b for _, b in pairs], device=logits.device, dtype=logits.dtype)
            logits[i, ids] += bias


def _token_counts(ids: list[list[int]], V: int, dev: torch.device) -> torch.Tensor:
    """[R, V] fp32 count of each token id per row."""
    counts = torch.zeros(len(ids), V, device=dev)
    flat = [t for row in ids for t in row]
    if flat:
        cols = torch.tensor(flat, device=dev)
        rows = torch.repeat_interleave(
            torch.arange(len(ids), device=dev), torch.tensor([len(r) for r in ids], device=dev)
        )
        counts.index_put_((rows, cols), torch.ones(len(flat), device=dev), accumulate=True)
    return counts


def _apply_penalties(
    logits: torch.Tensor,  # [B, V] fp32, modified in place
    rows: list[int],
    params: list[GenerationOptions],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
) -> None:
    dev = logits.device
    V = logits.shape[1]
    ps = [params[i] for i in rows]
    idx = torch.tensor(rows, device=dev)
    x = logits[idx]  # [R, V]
    out_counts = _token_counts([output_ids[i] for i in rows], V, dev)  # [R, V]
    out_seen = out_counts > 0

    if any(p.repetition_penalty != 1.0 for p in ps):
        # HF/vLLM: tokens seen in prompt or output get positive logits divided, negative multiplied.
        rep = torch.tensor([p.repetition_penalty for p in ps], device=dev)[:, None]
        seen = out_seen | (_token_counts([prompt_ids[i] for i in rows], V, dev) > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)

    # OpenAI: logit -= frequency * count + presence * (count > 0), over output tokens only.
    freq = torch.tensor([p.frequency_penalty for p in ps], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in ps], device=dev)[:, None]
    x = x - freq * out_counts - pres * out_seen.float()
    logits[idx] = x


def _truncated_draw(
    logits: torch.Tensor,  # [R, V], before temperature
    temps: torch.Tensor,  # [R]
    ks: list[int],
    top_ps: list[float],
    min_ps: list[float],
    u: torch.Tensor,  # [R] float64
) -> list[int] | None:
    """The fast path when every row is truncated by top-k or top-p: the same draw as the full
    path (top-k -> softmax -> top-p -> min-p -> inverse CDF in token-id order), computed on each
    row's top candidates instead of the whole vocabulary: no full-vocabulary sort, cumulative sum
    or mask. Top-p rows try 64, then 256, then TOP_P_CANDIDATES candidates (a large `topk` costs
    more than its small first tries). None (use the full path) when a row is not truncated, when
    a top-k boundary is tied (the full path keeps ties), or when a top-p row's candidates do not
    reach its mass."""
    if not all(k > 0 or p < 1.0 for k, p in zip(ks, top_ps)):
        return None
    V = logits.shape[1]
    if any(k >= V for k in ks):
        return None
    dev = logits.device
    has_k = torch.tensor([k > 0 for k in ks], device=dev)
    k_row = torch.tensor([k for k in ks], device=dev)
    p = torch.tensor(top_ps, device=dev)[:, None]
    on_p = p[:, 0] < 1.0
    whole = (~has_k).nonzero()[:, 0]  # top-p rows without top-k: normalized over the vocabulary
    lse_whole = None
    if whole.numel():
        lse_whole = torch.logsumexp(
            logits[whole].float() / temps[whole, None], dim=-1, keepdim=True
        )
    k_max = max(ks) + 1  # one more than k: a tie at the k-th logit shows as an equal (k+1)-th
    for c in (64, 256, TOP_P_CANDIDATES):
        K = min(V, max(k_max, c if whole.numel() else 0))
        raw, ids = logits.topk(K, dim=-1)  # [R, K], descending (a temperature keeps the order)
        if bool(has_k.any()):
            at = raw.gather(1, (k_row - 1).clamp_min(0)[:, None])  # the k-th
            after = raw.gather(1, k_row.clamp_max(K - 1)[:, None])  # the (k+1)-th
            if bool(((at == after)[:, 0] & has_k).any()):
                return None  # a tie at some row's k-th logit: the full path keeps every tie
        vals = raw.float() / temps[:, None]
        in_set = (torch.arange(K, device=dev)[None, :] < k_row[:, None]) | ~has_k[:, None]
        vals = vals.masked_fill(~in_set, float("-inf"))
        lse = torch.logsumexp(vals, dim=-1, keepdim=True)  # [R, 1]: over the k of top-k rows
        if lse_whole is not None:
            lse[whole] = lse_whole
        probs = torch.exp(vals - lse)  # [R, K], descending, 0 outside the set
        if not bool(on_p.any()):
            break
        thr, settled = _top_p_threshold(probs, p)  # [R, 1], [R]
        if not bool((on_p & ~has_k & ~settled).any()):
            probs = torch.where(on_p[:, None] & (probs < thr), torch.zeros_like(probs), probs)
            break
        if K == V or c == TOP_P_CANDIDATES:
            return None  # the candidates hold less than top_p of the mass: the full path
    if any(m > 0.0 for m in min_ps):
        min_p = torch.tensor(min_ps, device=dev)[:, None]
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
    order = ids.argsort(dim=-1)  # the inverse CDF runs in token-id order, as over the vocabulary
    chosen = _inverse_cdf(probs.gather(1, order), u)
    ids_in_order = ids.gather(1, order)
    return [int(ids_in_order[r, j]) for r, j in enumerate(chosen)]


def _top_k(x: torch.Tensor, ks: list[int]) -> None:
    """Mask all but the k largest logits of each row in place; k = 0 leaves the row alone."""
    V = x.shape[1]
    ks = [min(k, V) for k in ks]
    top = x.topk(max(ks), dim=-1).values  # [R, max_k]
    k = torch.tensor(ks, device=x.device)
    kth = top.gather(1, (k - 1).clamp_min(0)[:, None])  # [R, 1]
    kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
    x.masked_fill_(x < kth, float("-inf"))


def _top_p(probs: torch.Tensor, top_ps: list[float]) -> None:
    """Zero, in place, all but the smallest set of most likely tokens whose mass reaches top_p.

    Tokens tied with the least likely kept one are kept too, so the set does not depend on how a
    sort orders ties. Most rows are settled by the top TOP_P_CANDIDATES tokens; only rows whose
    candidates do not reach top_p pay for a full sort (slow on CPU).
    """
    on = [j for j, p in enumerate(top_ps) if p < 1.0]
    idx = torch.tensor(on, device=probs.device)
    sub = probs[idx]  # [R', V]
    p = torch.tensor([top_ps[j] for j in on], device=probs.device)[:, None]
    top = sub.topk(min(TOP_P_CANDIDATES, sub.shape[1]), dim=-1).values  # [R', k] descending
    thr, settled = _top_p_threshold(top, p)  # [R', 1], [R']
    short = (~settled).nonzero()[:, 0]
    if short.numel():
        full = sub[short].sort(dim=-1, descending=True).values  # [R'', V]
        thr[short] = _top_p_threshold(full, p[short])[0]
    probs[idx] = sub.masked_fill(sub < thr, 0.0)


def _top_p_threshold(
    sorted_probs: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ranks whose mass before them is <= p. Returns the smallest kept probability [R, 1]
    and whether it is final [R]: the mass of all given ranks exceeds p, so no later rank is kept."""
    cum = sorted_probs.cumsum(dim=-1)  # [R, k]
    kept = (cum - sorted_probs <= p).sum(dim=-1, keepdim=True)  # >= 1: nothing before rank 0
    return sorted_probs.gather(1, kept - 1), cum[:, -1] > p[:, 0]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Per row, the token where u (in [0, 1)) falls in the cumulative mass of probs (unnormalized,
    zeros never chosen). The cumulative sum is float64 so the far tail keeps its share."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [R, V]
    total = cdf[:, -1:].contiguous()  # [R, 1]
    target = torch.minimum(u[:, None] * total, total)
    chosen = torch.searchsorted(cdf, target, right=True)  # first cdf > target
    # u * total can round up to total: fall back to the last token with positive mass.
    last = torch.searchsorted(cdf, total)  # first cdf >= total
    return torch.minimum(chosen, last)[:, 0].tolist()


def _fill_logprobs(
    out: SampleOutput, logits: torch.Tensor, rows: list[int], params: list[GenerationOptions]
) -> None:
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)  # [R, V]
    chosen = torch.tensor([out.token_ids[i] for i in rows], device=dev)
    chosen_lp = lp.gather(1, chosen[:, None])[:, 0].tolist()
    n = max(params[i].top_logprobs for i in rows)
    top_vals, top_ids = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
    vals: list[list[float]] = top_vals.tolist()
    ids: list[list[int]] = top_ids.tolist()
    for j, i in enumerate(rows):
        k = params[i].top_logprobs
        out.logprobs[i] = chosen_lp[j]
        out.top_logprobs[i] = list(zip(ids[j][:k], vals[j][:k]))
