"""Decode side, one per request: handshake (cached per peer), lease renewal from the moment the
request arrives, then a pull into its own pre-allocated slots once `init()` hands them over.

Bootstrapping -> WaitingForInput (P confirmed it holds the transfer, pools are compatible)
-> Transferring (reads posted; the poller drives them) -> Success (P is told `done`).
Any failure -> Failed with a reason; transfer handles are released and P is told `abort`.
"""

from __future__ import annotations

import asyncio
import time

from pd.protocol.wire import TransferParams
from pd.transfer.base import KVReceiver, ReceiverHost, ReceiverLink, SlotIds
from pd.transfer.errors import PoolError, TransferError
from pd.transfer.messages import Abort, Done
from pd.transfer.plan import ReadBatch, plan_reads, rank_segments
from pd.transfer.poll import KVPoll, PollState


class Receiver(KVReceiver):
    def __init__(self, host: ReceiverHost, params: TransferParams) -> None:
        self.transfer_id = params.transfer_id
        self.params = params
        self._host = host
        self._state = PollState(KVPoll.Bootstrapping)
        self._event = asyncio.Event()
        self._link: ReceiverLink | None = None
        self._dst: SlotIds | None = None
        self._xfer: int | None = None
        self._unsafe_xfer: int | None = None  # an uncancelled read, until the transport settles it
        self._deadline = 0.0
        self.dst_unsafe = False
        self.started_at: float | None = None
        self.finished_at: float | None = None
        loop = asyncio.get_running_loop()
        self._handshake_timer = loop.call_later(
            host.config.handshake_timeout_s, self._handshake_deadline
        )
        self._task: asyncio.Task | None = asyncio.create_task(self._bootstrap())

    def poll(self) -> KVPoll:
        return self._state.state

    @property
    def failure_reason(self) -> str | None:
        return self._state.reason

    async def wait(self) -> KVPoll:
        await self._event.wait()
        return self._state.state

    def init(self, dst_slots: SlotIds) -> None:
        if self._dst is not None:
            raise TransferError(f"transfer {self.transfer_id}: init() called twice")
        if set(dst_slots) != set(self.params.page_ids):
            raise PoolError(
                f"transfer {self.transfer_id}: pools {sorted(dst_slots)} != "
                f"{sorted(self.params.page_ids)}"
            )
        for name, ids in dst_slots.items():
            if len(ids) != len(self.params.page_ids[name]):
                raise PoolError(
                    f"transfer {self.transfer_id}: pool {name!r} needs "
                    f"{len(self.params.page_ids[name])} slots, got {len(ids)}"
                )
        self._dst = {k: list(v) for k, v in dst_slots.items()}
        self._maybe_start()

    def abort(self, reason: str = "aborted by decode") -> None:
        self._fail(reason, tell_prefill=True)

    # -- bootstrap -------------------------------------------------------------------------

    async def _bootstrap(self) -> None:
        try:
            link = await self._host.link_to(self.params)
            for name in self.params.page_ids:
                if name not in self._host.pools or name not in link.pools:
                    raise PoolError(f"pool {name!r} is not registered on both sides")
                rank_segments(self._host.pools[name], link.pools[name])  # raises if incompatible
        except TransferError as e:
            self._task = None
            self._fail(f"{type(e).__name__}: {e}", tell_prefill=False)
            return
        self._task = None
        if self._state.done:
            return
        self._link = link
        link.attach(self.transfer_id, self)

    def _handshake_deadline(self) -> None:
        if self._state.state is KVPoll.Bootstrapping:
            self._fail(
                f"handshake with {self.params.remote_host}:{self.params.remote_port} not done "
                f"within {self._host.config.handshake_timeout_s}s",
                tell_prefill=True,
            )

    # -- called by the peer link -----------------------------------------------------------

    def on_attached(self) -> None:
        if self._state.advance(KVPoll.WaitingForInput):
            self._handshake_timer.cancel()
            self._maybe_start()

    def on_unknown(self) -> None:
        self._fail(
            f"prefill does not hold transfer {self.transfer_id} (lease expired or aborted)",
            tell_prefill=False,
        )

    def on_remote_abort(self, reason: str) -> None:
        self._fail(f"aborted by prefill: {reason}", tell_prefill=False)

    def on_peer_lost(self, reason: str) -> None:
        self._fail(f"PeerLostError: {reason}", tell_prefill=False)

    # -- pull ------------------------------------------------------------------------------

    def _maybe_start(self) -> None:
        if (
            self._state.state is not KVPoll.WaitingForInput
            or self._dst is None
            or self._link is None
        ):
            return
        link, cfg = self._link, self._host.config
        try:
            batches: list[ReadBatch] = []
            for name, src in self.params.page_ids.items():
                batches += plan_reads(
                    self._host.pools[name],
                    link.pools[name],
                    src,
                    self._dst[name],
                    max_desc_bytes=cfg.max_desc_bytes,
                )
            self.started_at = time.monotonic()
            self._xfer = self._host.backend.start_read(link.agent, batches)
        except TransferError as e:
            self._fail(f"{type(e).__name__}: {e}", tell_prefill=True)
            return
        self._state.advance(KVPoll.Transferring)
        self._deadline = self.started_at + cfg.transfer_timeout_s
        self._host.poller.add(self)

    def progress(self, now: float) -> bool:
        """One poll of the in-flight reads (called by the poller)."""
        if self._state.done or self._xfer is None:
            return True
        state = self._host.backend.check(self._xfer).value
        if state == "DONE":
            self._succeed()
        elif state == "ERR":
            if self._link is not None:
                self._link.suspect()  # a dead peer is then found by its missed heartbeats
            self._fail(
                "TransferFailed: transport error while reading from prefill", tell_prefill=True
            )
        elif now > self._deadline:
            self._fail(
                f"TransferFailed: pull not done within {self._host.config.transfer_timeout_s}s",
                tell_prefill=True,
            )
        return self._state.done

    def poll_failed(self, error: Exception) -> None:
        self._fail(
            f"TransferFailed: checking the pull raised {type(error).__name__}: {error}",
            tell_prefill=True,
        )

    def _succeed(self) -> None:
        if not self._state.advance(KVPoll.Success):
            return
        self.finished_at = time.monotonic()
        self._release_xfer()
        if self._link is not None:
            self._link.send(Done(self.transfer_id))
            self._link.detach(self.transfer_id)
        self._host.forget_receiver(self)
        self._event.set()

    def _fail(self, reason: str, *, tell_prefill: bool) -> None:
        if not self._state.fail(reason):
            return
        self.finished_at = time.monotonic()
        self._handshake_timer.cancel()
        self._release_xfer()
        self._host.poller.discard(self)
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        if self._link is not None:
            if tell_prefill:
                self._link.send(Abort(self.transfer_id, reason))
            self._link.detach(self.transfer_id)
        self._host.forget_receiver(self)
        self._event.set()

    def reclaim(self) -> bool:
        if self._unsafe_xfer is not None and self._host.backend.settled(self._unsafe_xfer):
            self._unsafe_xfer = None
            self.dst_unsafe = False
        return not self.dst_unsafe

    def _release_xfer(self) -> None:
        if self._xfer is not None:
            if not self._host.backend.release(self._xfer):
                self.dst_unsafe = True
                self._unsafe_xfer = self._xfer
            self._xfer = None
