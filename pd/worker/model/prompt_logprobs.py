"""The prompt's logprobs: at each prompt position, the log-softmax of the logits there, read at
the next prompt token (its logprob and rank) and at the most likely tokens.

The runner asks for logits rows at the prompt positions of the requests that want them
(`GenerationOptions.prompt_logprobs`), chunk by chunk as the prompt is prefilled; a request that
does not ask costs nothing here. Values are fp32 log_softmax of the raw model logits (no bias,
penalty or temperature: as vLLM reports prompt logprobs).
"""

from __future__ import annotations

import torch

# One prompt position: (logprob of the next prompt token, its rank (1: the most likely), the
# most likely (token id, logprob) alternatives, most likely first).
PromptLogprob = tuple[float, int, list[tuple[int, float]]]

ROWS_AT_ONCE = 128  # rows log-softmaxed at a time: bounds the fp32 [rows, V] copies


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[PromptLogprob]:
    """Per row of `logits` ([R, V]): the logprob and rank of `targets[row]`, and the top `k`."""
    assert logits.shape[0] == len(targets), "one target per row"
    out: list[PromptLogprob] = []
    for start in range(0, len(targets), ROWS_AT_ONCE):
        rows = logits[start : start + ROWS_AT_ONCE]
        lp = torch.log_softmax(rows.float(), dim=-1)  # [r, V]
        target = torch.tensor(targets[start : start + ROWS_AT_ONCE], device=lp.device)
        chosen = lp.gather(1, target[:, None])  # [r, 1]
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        if k:
            top_vals, top_ids = lp.topk(k, dim=-1)
            vals: list[list[float]] = top_vals.tolist()
            ids: list[list[int]] = top_ids.tolist()
        else:
            vals, ids = [[] for _ in ranks], [[] for _ in ranks]
        for lp_j, rank, vs, ts in zip(chosen[:, 0].tolist(), ranks, vals, ids):
            out.append((lp_j, rank, list(zip(ts, vs))))
    return out
