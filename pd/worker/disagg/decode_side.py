"""Decode role: validate P's `kv_transfer_params`, pull the KV, then decode from there.

A request arriving with params from a prefill worker:
1. is checked against this worker (model fingerprint, page size, layout, dtype): a mismatch is a
   clear 400, never silent garbage; then it is queued in the engine (which checks that it fits);
2. dials P (handshake, lease renewals start at once); its response headers and first token (P's,
   carried in the params) go out as soon as the handshake is done;
3. waits for pages (`HeldPages.reserve`: they must fit beside the running batch's growth),
   pulls P's pages into them, and joins the running batch at position `num_tokens`.
A failed pull, a client that leaves, or a dead P releases the reserved pages exactly once.

A request without params is not this module's: the engine prefills it here, from this worker's
own prefix cache, and decodes it as a co-located worker would (decode-local prefill, which the
router chooses when little of the prompt is new to this worker).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pd.protocol import APIError, GenerationOptions, KVTransferParams, bad_request
from pd.transfer import KVPoll, KVReceiver, TransferManager, TransferParams
from pd.worker.disagg.contract import KV_POOL, TransferRole
from pd.worker.engine import Engine, RequestHandle
from pd.worker.model import ModelRunner

log = logging.getLogger(__name__)

PAGE_WAIT_S = 0.005  # how often a request waiting for pages looks again


class DecodeSide(TransferRole):
    def __init__(self, manager: TransferManager, runner: ModelRunner, engine: Engine) -> None:
        super().__init__(manager, runner)
        self.engine = engine
        self.pages = engine.held_pages
        self._tasks: set[asyncio.Task] = set()

    def validate(self, raw: dict[str, Any]) -> KVTransferParams:
        kvp = KVTransferParams.from_dict(raw)
        ours = self.contract
        for name in ("model_fingerprint", "page_size", "kv_layout", "dtype"):
            theirs = getattr(kvp, name)
            if theirs != getattr(ours, name):
                raise APIError(
                    400,
                    f"prefill worker's {name} {theirs!r} does not match this decode worker's "
                    f"{getattr(ours, name)!r}: pair workers of the same model, dtype and page size",
                    code="kv_params_mismatch",
                    param="kv_transfer_params",
                )
        pages = kvp.page_ids.get(KV_POOL, [])
        if len(pages) != -(-kvp.num_tokens // kvp.page_size) or len(kvp.prompt_token_ids) != (
            kvp.num_tokens
        ):
            raise bad_request("kv_transfer_params are inconsistent", param="kv_transfer_params")
        return kvp

    async def admit(self, kvp: KVTransferParams, options: GenerationOptions) -> RequestHandle:
        """Queue the request, dial P, then emit P's first token; the pull goes on in a task."""
        # Raises if it cannot fit; P's prefix-cache hits are what this request's usage reports.
        handle = self.engine.add_pulled(kvp.prompt_token_ids, options, kvp.cached_tokens)
        try:
            rx = self.manager.create_receiver(TransferParams.from_dict(kvp.to_dict()))
        except BaseException:
            self.engine.abort(handle)
            raise
        handle.on_abort = lambda reason: _abort_unless_settled(rx, reason)
        try:
            while rx.poll() is KVPoll.Bootstrapping:  # bounded by the handshake deadline
                await asyncio.sleep(0.001)
            if rx.poll() is KVPoll.Failed:
                raise APIError(
                    502,
                    f"cannot reach the prefill worker's KV: {rx.failure_reason}",
                    "upstream_error",
                    "kv_transfer_failed",
                )
            self.engine.accept_first_token(handle, kvp.first_token_id, kvp.first_token_logprobs)
        except BaseException:  # refused, or the client left during the handshake: tell P
            self.engine.abort(handle, "the decode request ended before the pull")
            raise
        task = asyncio.create_task(self._pull(handle, rx, len(kvp.page_ids[KV_POOL])))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle

    async def _pull(self, handle: RequestHandle, rx: KVReceiver, num_pages: int) -> None:
        key = f"d-{handle.seq.request_id}"
        try:
            while (pages := self.pages.reserve(key, num_pages)) is None:  # the prealloc queue
                if handle.finished:
                    rx.abort("the client left before pages were free")
                    return
                await asyncio.sleep(PAGE_WAIT_S)
            if handle.finished:  # finished by its first token, or aborted: no pull needed
                rx.abort("request finished before the pull")
                self.pages.release(key)
                return
            rx.init({KV_POOL: pages})
            state = await rx.wait()
        except BaseException as e:
            rx.abort(f"decode side error: {e!r}")
            self._settle(rx, key)
            if not isinstance(e, asyncio.CancelledError):
                log.exception("KV pull of %s failed", handle.seq.request_id)
                self.engine.fail(handle, APIError(500, f"KV pull failed: {e}", "internal_error"))
            raise
        if state is KVPoll.Success and not handle.finished:
            self.engine.admit_pulled(handle, key)
            return
        self._settle(rx, key)
        if not handle.finished:
            self.engine.fail(
                handle,
                APIError(
                    502,
                    f"KV transfer failed: {rx.failure_reason}",
                    "upstream_error",
                    "kv_transfer_failed",
                ),
            )

    def _settle(self, rx: KVReceiver, key: str) -> None:
        """Free a failed pull's pages, unless a read might still land in them (NIXL could not
        cancel it): those stay held, counted in /health, never given to another request."""
        if getattr(rx, "dst_unsafe", False):
            log.error("KV pull %s could not be cancelled: keeping its pages out of use", key)
            return
        self.pages.release(key)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await super().stop()


def _abort_unless_settled(rx: KVReceiver, reason: str) -> None:
    if rx.poll() not in (KVPoll.Success, KVPoll.Failed):
        rx.abort(reason)
