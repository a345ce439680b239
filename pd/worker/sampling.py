"""Turn a batch of last-position logits into next tokens.

Order per row: penalties (repetition, then frequency/presence) -> logprobs -> greedy argmax, or
temperature -> top-k -> top-p -> min-p -> an exponential race (argmax of probs / Exp(1) noise,
which draws token i with probability probs[i]).

Logprobs convention: reported logprobs are log_softmax of the logits AFTER penalties and BEFORE
temperature and top-k/top-p/min-p truncation, in fp32. Without penalties they are the raw model
logprobs (what OpenAI and vLLM report by default).

Seeded rows: the noise of a row with a seed comes from a generator seeded with a 64-bit hash of
(seed, output position), where the output position is len(output_ids[row]), the index of the token
being generated (0 for the first). The same request therefore samples the same tokens on one worker
or on a prefill/decode pair (P samples position 0, D positions 1..), whatever else is in the batch.
On D, output_ids must include the first token that P sampled. The stream is the same on any
machine of one device type (CPU and CUDA generators differ).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from pd.worker.sampling_params import SamplingParams


@dataclass
class SampleOutput:
    token_ids: list[int]
    # Per row, aligned with token_ids; None where the row did not ask for logprobs.
    logprobs: list[float | None] = field(default_factory=list)
    # Per row: the top_logprobs most likely (token id, logprob), most likely first; [] when the row
    # asked for logprobs but top_logprobs=0; None when it did not ask.
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)


def seed_for_position(seed: int, position: int) -> int:
    """A 64-bit generator seed derived only from (request seed, output position)."""
    digest = hashlib.blake2b(f"{int(seed)}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed  # for the shared stream of unseeded rows; None = nondeterministic
        self._shared: dict[torch.device, torch.Generator] = {}
        self._per_row: dict[torch.device, torch.Generator] = {}

    def sample(
        self,
        logits: torch.Tensor,  # [B, V], any float dtype; not modified
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
    ) -> SampleOutput:
        B, V = logits.shape
        assert len(params) == len(prompt_ids) == len(output_ids) == B, "batch size mismatch"

        penalized = [i for i, p in enumerate(params) if p.uses_penalties]
        if penalized:
            logits = logits.to(torch.float32, copy=True)  # [B, V]
            _apply_penalties(logits, penalized, params, prompt_ids, output_ids)

        token_ids = [0] * B
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        if len(greedy) == B:
            token_ids = logits.argmax(dim=-1).tolist()
        else:
            if greedy:
                idx = torch.tensor(greedy, device=logits.device)
                for i, t in zip(greedy, logits[idx].argmax(dim=-1).tolist()):
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
        params: list[SamplingParams],
        output_ids: list[list[int]],
    ) -> list[int]:
        dev = logits.device
        ps = [params[i] for i in rows]
        idx = torch.tensor(rows, device=dev)
        temps = torch.tensor([p.temperature for p in ps], device=dev)
        x = logits[idx].float() / temps[:, None]  # [R, V] fp32

        ks = [p.top_k if p.top_k > 0 else 0 for p in ps]
        if any(ks):
            _top_k(x, ks)
        if any(p.top_p < 1.0 for p in ps):
            x = _top_p(x, [p.top_p for p in ps])
        if any(p.min_p > 0.0 for p in ps):
            min_p = torch.tensor([p.min_p for p in ps], device=dev)
            # probs < min_p * max_prob  <=>  logit < max_logit + log(min_p)
            cutoff = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
            x.masked_fill_(x < cutoff, float("-inf"))
        probs = torch.softmax(x, dim=-1)  # [R, V]

        noise = torch.empty_like(probs)  # [R, V], Exp(1)
        unseeded = [j for j, p in enumerate(ps) if p.seed is None]
        if len(unseeded) == len(ps):
            noise.exponential_(generator=self._shared_generator(dev))
        elif unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_(
                generator=self._shared_generator(dev)
            )
        for j, p in enumerate(ps):
            if p.seed is not None:
                gen = self._row_generator(dev, p.seed, len(output_ids[rows[j]]))
                noise[j] = torch.empty(probs.shape[1], device=dev).exponential_(generator=gen)
        # NOTE: a zero noise value would turn a masked token (prob 0) into 0/0 = NaN, which argmax
        # picks; keep the noise strictly positive.
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        return (probs / noise).argmax(dim=-1).tolist()

    def _shared_generator(self, dev: torch.device) -> torch.Generator:
        gen = self._shared.get(dev)
        if gen is None:
            gen = torch.Generator(device=dev)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[dev] = gen
        return gen

    def _row_generator(self, dev: torch.device, seed: int, position: int) -> torch.Generator:
        gen = self._per_row.get(dev)
        if gen is None:
            gen = self._per_row[dev] = torch.Generator(device=dev)
        gen.manual_seed(seed_for_position(seed, position))
        return gen


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
    params: list[SamplingParams],
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


def _top_k(x: torch.Tensor, ks: list[int]) -> None:
    """Mask all but the k largest logits of each row in place; k = 0 leaves the row alone."""
    V = x.shape[1]
    ks = [min(k, V) for k in ks]
    top = x.topk(max(ks), dim=-1).values  # [R, max_k]
    k = torch.tensor(ks, device=x.device)
    kth = top.gather(1, (k - 1).clamp_min(0)[:, None])  # [R, 1]
    kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
    x.masked_fill_(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    p = torch.tensor([tp if tp < 1.0 else float("inf") for tp in top_ps], device=x.device)
    sorted_x, order = x.sort(dim=-1, descending=True)  # [R, V]
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [R, V]
    sorted_x.masked_fill_(mass_before > p[:, None], float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _fill_logprobs(
    out: SampleOutput, logits: torch.Tensor, rows: list[int], params: list[SamplingParams]
) -> None:
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)  # [R, V]
    chosen = torch.tensor([out.token_ids[i] for i in rows], device=dev)
    chosen_lp = lp.gather(1, chosen[:, None])[:, 0].tolist()
    n = max(params[i].top_logprobs for i in rows)
    top_vals, top_ids = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = params[i].top_logprobs
        out.logprobs[i] = chosen_lp[j]
        out.top_logprobs[i] = list(zip(top_ids[j][:k], top_vals[j][:k]))
