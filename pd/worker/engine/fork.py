"""`n` > 1: one prompt prefilled once, forked into n choices that share its full pages.

A request with n choices is one parent sequence (choice 0), queued as any request, and n - 1
children (status FORKING: no pages, in no queue) the scheduler keeps beside it (`Forks`).

1. The step that samples the parent's first token carries the children as riders
   (`ScheduledBatch.riders`): the runner samples each child's first token from the parent's
   logits row, with the child's own options (choice i's seed is the request's seed + i, so a
   seeded choice is the same however the request is served).
2. When that step ends (`Scheduler.advance`), each child takes one reference on each of the
   parent's full prompt pages (as a prefix hit does: refcounted in the cache manager) and joins
   the running batch at the page boundary. Its next step recomputes the prompt's partial last
   page (len(prompt) % page_size tokens, fewer than a page) plus its first token, into a page of
   its own: recompute, not a copy of the KV page, so no KV write happens outside a forward pass.
3. From there every choice is an ordinary sequence: it stops on its own and frees its own pages.

A request whose KV comes from elsewhere is a parent too: its children fork from its pages once
the KV arrived (`Scheduler.admit_arrived`), each from its own first token (sampled where the KV
was computed, and carried in `kv_transfer_params.first_token_ids`). A parent that ends before its first
token (abort, error) leaves its children as ordinary waiting requests: they prefill themselves.
"""

from __future__ import annotations

from dataclasses import replace

from pd.protocol import GenerationOptions
from pd.worker.engine.batch import ScheduledBatch
from pd.worker.engine.request import SeqStatus, Sequence

Forks = dict[Sequence, list[Sequence]]  # parent -> its children still FORKING


def choice_options(options: GenerationOptions, index: int) -> GenerationOptions:
    """Choice `index`'s options: its own random stream (seed + index) when seeded."""
    if index == 0 or options.seed is None:
        return options
    return replace(options, seed=options.seed + index)


def attach_riders(batch: ScheduledBatch, forks: Forks) -> None:
    """Let the children of every parent whose first token this step samples ride on its row."""
    if not forks:
        return
    row = 0
    for seq, sample in zip(batch.seqs, batch.sample):
        if not sample:
            continue
        if not seq.output_ids and seq in forks:
            batch.riders.extend((row, c) for c in forks[seq] if c.status is SeqStatus.FORKING)
        row += 1
