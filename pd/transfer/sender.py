"""Prefill side, one per request: holds the request's slots under a lease until done/abort/expiry.

The slots belong to their owner (the worker's KV cache); the sender never frees them itself but
calls `on_release(sender, reason)` exactly once, with reason "done", "abort", "lease_expired"
(no decode worker claimed it within the lease) or "decode_lost" (the decode worker that claimed it
stopped heartbeating). The lease is a time-to-live on this machine's monotonic clock; no clock is
compared across machines. Until a decode worker claims the transfer it is the full lease (the
router is between P's answer and D's call); once claimed, D renews it on every heartbeat, so a
renewal lasts only `renewal_ttl_s` (a few heartbeat intervals): a dead D is seen within seconds.
Nothing polls: a timer per sender fires at the deadline and re-arms itself if it moved meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pd.protocol.wire import TransferParams
from pd.transfer.base import KVSender, ReleaseCallback, SenderHost, SlotIds
from pd.transfer.messages import Abort
from pd.transfer.poll import KVPoll, PollState

if TYPE_CHECKING:
    from pd.transfer.session import Session

log = logging.getLogger(__name__)
# Aborts being sent to decode peers: asyncio keeps only weak references to tasks.
_SENDING: set[asyncio.Future] = set()


class Sender(KVSender):
    def __init__(
        self,
        host: SenderHost,
        transfer_id: str,
        slots: SlotIds,
        lease_ttl_s: float,
        on_release: ReleaseCallback,
    ) -> None:
        self.transfer_id = transfer_id
        self.slots = {k: list(v) for k, v in slots.items()}
        self.lease_ttl_s = lease_ttl_s
        self._host = host
        self._on_release: ReleaseCallback | None = on_release
        self._state = PollState(KVPoll.WaitingForInput)
        self._deadline = time.monotonic() + lease_ttl_s
        self._timer: asyncio.TimerHandle | None = None
        self._arm(lease_ttl_s)
        self.session: Session | None = None  # the decode session that renews the lease
        self.release_reason: str | None = None

    def poll(self) -> KVPoll:
        return self._state.state

    @property
    def failure_reason(self) -> str | None:
        return self._state.reason

    @property
    def lease_remaining_s(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def params(self) -> TransferParams:
        h = self._host
        return TransferParams(
            remote_host=h.advertise_host,
            remote_port=h.bootstrap_port,
            remote_engine_id=h.engine_id,
            transfer_id=self.transfer_id,
            page_ids={k: list(v) for k, v in self.slots.items()},
            lease_ttl_s=self.lease_ttl_s,
        )

    def abort(self, reason: str = "aborted by prefill") -> None:
        if self._state.fail(reason):
            if self.session is not None:
                task = asyncio.ensure_future(
                    self._host.server_send(self.session, Abort(self.transfer_id, reason))
                )
                _SENDING.add(task)
                task.add_done_callback(_SENDING.discard)
            self._release("abort")

    # -- driven by the host on bootstrap messages ----------------------------------------

    def renew(self, session: Session) -> None:
        if self._state.done:
            return
        ttl = min(self.lease_ttl_s, self._host.renewal_ttl_s)
        self._deadline = time.monotonic() + ttl
        if self._timer is not None and self._timer.when() > asyncio.get_running_loop().time() + ttl:
            self._arm(ttl)  # the first renewal brings the deadline forward
        self.session = session
        self._state.advance(KVPoll.Transferring)  # D holds the request and will pull

    def on_done(self) -> None:
        if self._state.advance(KVPoll.Success):
            self._release("done")

    def on_remote_abort(self, reason: str) -> None:
        if self._state.fail(f"aborted by decode: {reason}"):
            self._release("abort")

    def _check_lease(self) -> None:
        self._timer = None
        if self._state.done:
            return
        left = self._deadline - time.monotonic()
        if left > 0:
            self._arm(left)
            return
        if self.session is not None:
            reason = f"the decode worker stopped renewing for {self._host.renewal_ttl_s}s"
            if self._state.fail(reason):
                self._release("decode_lost")
        elif self._state.fail(f"lease of {self.lease_ttl_s}s expired without renewal"):
            self._release("lease_expired")

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(delay, self._check_lease)

    def _release(self, reason: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._host.forget_sender(self)
        self.release_reason = reason
        callback, self._on_release = self._on_release, None
        if callback is not None:
            try:
                callback(self, reason)  # NOTE: done | abort | lease_expired | decode_lost
            except Exception:
                log.exception("release callback of transfer %s failed", self.transfer_id)
