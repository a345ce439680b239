"""Prefill role: hand a prefilled request's KV to a decode worker.

When a request sent with `kv_transfer_params={"do_remote_decode": true}` (the prefill role
`expect`s it) ends at its length, its first token out, the engine tells this side, its connector
(`request_finished`): it pins the pages (lent by the engine under the transfer id), and a
`KVSender` offers them to the decode side. They are freed exactly once, when the sender releases
them: on D's `done`, on an abort from either side, or when the lease runs out.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from pd.protocol import KVTransferParams
from pd.signing import sign_params
from pd.transfer import KVSender, TransferManager
from pd.worker.disagg.contract import KV_POOL, KVRunner, TransferRole
from pd.worker.engine import FirstToken, KVConnector, LentPages, LogprobEntry, Sequence

log = logging.getLogger(__name__)


class PrefillSide(TransferRole, KVConnector):
    name = "prefill"
    lent_pages_field = "kv_pages_pinned"

    def __init__(
        self,
        manager: TransferManager,
        runner: KVRunner,
        pages: LentPages,
        tp_size: int,
        token: bytes | None = None,
    ) -> None:
        super().__init__(manager, runner)
        self.pages = pages
        self.tp_size = tp_size
        self.token = token  # the cluster token: the params it answers are signed with it
        self.released: dict[str, int] = {}  # release reason -> count, for tests and metrics
        self._remote: weakref.WeakSet[Sequence] = weakref.WeakSet()  # to hand off at the end

    def expect(self, seq: Sequence) -> None:
        """`seq` decodes elsewhere: hand its KV off when it ends at its length."""
        self._remote.add(seq)

    def request_finished(
        self, seq: Sequence, reasons: list[str], firsts: list[FirstToken]
    ) -> dict[str, Any] | None:
        if seq not in self._remote or "length" not in reasons:
            return None
        self._remote.discard(seq)
        return self.hand_off(seq, firsts)

    def hand_off(self, seq: Sequence, firsts: list[FirstToken]) -> dict[str, Any]:
        """Pin `seq`'s pages for a decode worker; returns the `kv_transfer_params` to answer
        (with n > 1, every choice's first token, in `firsts`: one set of pages), signed with
        the cluster token (pd/signing.py)."""
        # A continuation's first token follows its given outputs (prefilled with the prompt).
        given = seq.output_ids[: seq.num_given]
        first_logprobs = firsts[0][1]
        key = f"p-{seq.request_id}"
        pages = self.pages.lend(seq, key)
        sender: KVSender | None = None
        try:
            sender = self.manager.create_sender(
                {KV_POOL: pages}, on_release=lambda s, why: self._release(key, why)
            )
            c = self.contract
            params = KVTransferParams.extending(
                sender.params(),
                prompt_token_ids=seq.prompt_ids,
                first_token_id=firsts[0][0],
                output_token_ids=given if seq.num_given else None,
                first_token_logprobs=_entry(first_logprobs),
                first_token_ids=[t for t, _ in firsts] if len(firsts) > 1 else None,
                first_tokens_logprobs=(
                    [_entry(lp) for _, lp in firsts] if len(firsts) > 1 and first_logprobs else None
                ),
                num_tokens=len(seq.prompt_ids) + len(given),
                cached_tokens=seq.num_cached_tokens or 0,
                prompt_logprobs=(
                    [[lp, rank, [[t, v] for t, v in top]] for lp, rank, top in seq.prompt_logprobs]
                    if seq.params.prompt_logprobs is not None
                    else None
                ),
                page_size=c.page_size,
                tp_size=self.tp_size,
                kv_layout=c.kv_layout,
                dtype=c.dtype,
                model_fingerprint=c.model_fingerprint,
            ).to_dict()
            return params if self.token is None else sign_params(self.token, params)
        except Exception:
            if sender is not None:
                sender.abort("hand-off failed")  # its release frees the pages
            self.pages.give_back(key)  # idempotent
            raise

    def release(self, transfer_id: str, reason: str) -> bool:
        """Give up a transfer no decode worker will pull; False when it is not held (done,
        released before, or never ours)."""
        return self.manager.abort_sender(transfer_id, reason)

    def _release(self, key: str, reason: str) -> None:
        self.pages.give_back(key)
        self.released[reason] = self.released.get(reason, 0) + 1
        if reason != "done":
            log.info("released pinned KV %s: %s", key, reason)


def _entry(lp: LogprobEntry | None) -> list | None:
    """A first token's logprobs as kv_transfer_params carry them: [logprob, top]."""
    return [lp[1], lp[2]] if lp else None
