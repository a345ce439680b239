"""Decode role: validate P's `kv_transfer_params`, pull the KV, then decode from there.

A request arriving with params from a prefill worker:
1. is checked against this worker (model fingerprint, page size, layout, dtype): a mismatch is a
   clear 400, never silent garbage; then it is queued in the engine (which checks that it fits);
2. dials P (handshake, lease renewals start at once); its response headers and first token (P's,
   carried in the params) go out as soon as the handshake is done;
3. waits in this side's prealloc queue (`PageWaitQueue`, first come first served; the engine
   tells it whenever pages may have come free) for pages that fit beside the running batch's
   growth, pulls P's pages into them, and joins the running batch at position `num_tokens`.
A failed pull, a client that leaves, a dead P, a lost lease or a wait past its deadline ends the
request and tells P (its pins go at once); reserved pages are released exactly once. Pages a
read that could not be cancelled may still land in are quarantined until the transport says the
read has ended, or for at most `quarantine_s`, and then released.

A request without params is not this module's: the decode role (roles.py) has the engine prefill
it here, from this worker's own prefix cache, and decode it as a co-located worker would
(decode-local prefill, which the router chooses when little of the prompt is new to this worker).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pd.protocol import APIError, GenerationOptions, KVTransferParams, bad_request
from pd.transfer import KVPoll, KVReceiver, TransferManager
from pd.worker.disagg.contract import KV_POOL, KVRunner, TransferRole
from pd.worker.disagg.page_wait import PageWaitQueue
from pd.worker.engine import AdmitRequest, Engine, KVConnector, RequestHandle, every_choice
from pd.worker.text.token_rules import TokenRules

log = logging.getLogger(__name__)

QUARANTINE_POLL_S = 0.2  # how often a quarantined pull asks the transport whether it ended


class DecodeSide(TransferRole, KVConnector):
    """The decode worker's connector: a request with P's params waits for its KV (pulled into
    pages the engine lends), its requests waiting for pages are counted in the engine's load."""

    name = "decode"
    lent_pages_field = "kv_pages_reserved"

    def __init__(
        self,
        manager: TransferManager,
        runner: KVRunner,
        engine: Engine,
        quarantine_s: float = 30.0,
        page_wait_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(manager, runner)
        self.engine = engine
        self.quarantine_s = quarantine_s
        # Pulls waiting for their pages: the engine tells it whenever pages may have come free.
        self.page_wait = PageWaitQueue(engine.lent_pages, page_wait_timeout_s)
        engine.connect(self)
        self.quarantined = 0  # pulls whose pages went into quarantine (for tests and logs)
        # Token ids this worker can embed: the tokenizer's, within the model's (padded) rows.
        self.vocab_size = min(engine.tokenizer.vocab_size, runner.config.vocab_size)
        self._tasks: set[asyncio.Task] = set()

    def validate(
        self, raw: dict[str, Any], n: int = 1, continuation: list[int] | None = None
    ) -> KVTransferParams:
        """P's params for this request (`continuation`: its pd_continuation's ids, which P's
        `output_token_ids` must repeat); a 400 on anything that does not fit."""
        kvp = KVTransferParams.from_dict(raw)
        if (kvp.output_token_ids or None) != (continuation or None):
            raise bad_request(
                "kv_transfer_params.output_token_ids disagree with pd_continuation",
                param="pd_continuation",
            )
        given = kvp.output_token_ids or []
        firsts = kvp.first_token_ids or [kvp.first_token_id]
        lps = kvp.first_tokens_logprobs
        if len(firsts) != n or firsts[0] != kvp.first_token_id or (lps and len(lps) != n):
            raise bad_request(
                f"kv_transfer_params carry {len(firsts)} first tokens for n={n}",
                param="kv_transfer_params",
            )
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
        if (
            len(pages) != -(-kvp.num_tokens // kvp.page_size)
            or len(kvp.prompt_token_ids) + len(given) != kvp.num_tokens
        ):
            raise bad_request("kv_transfer_params are inconsistent", param="kv_transfer_params")
        # Ids past the vocabulary would fail the forward pass of every request in the batch (on
        # CUDA a device-side assert): refused at the door, as a client's own prompt ids are.
        if kvp.num_tokens >= self.engine.max_model_len:
            raise APIError(
                400,
                f"the prompt has {kvp.num_tokens} tokens but this decode worker's context "
                f"length is {self.engine.max_model_len}",
                code="context_length_exceeded",
                param="kv_transfer_params",
            )
        vocab = self.vocab_size
        if max([*kvp.prompt_token_ids, *given, *firsts]) >= vocab:
            raise bad_request(
                f"kv_transfer_params carry a token id out of the vocabulary (size {vocab})",
                param="kv_transfer_params",
            )
        return kvp

    async def admit(
        self,
        kvp: KVTransferParams,
        options: GenerationOptions,
        cache_salt: str | None = None,
        rules: TokenRules | None = None,
        n: int = 1,
        choice_rules: list[TokenRules | None] | None = None,
        priority: int = 0,
    ) -> RequestHandle:
        """Queue the request, dial P, then emit P's first token (each choice's, with n > 1: the
        choices fork from the one pull); the pull goes on in a task. Its pages join this
        worker's prefix cache under the client's `cache_salt`."""
        prompt_logprobs = None
        if options.prompt_logprobs is not None:  # P computed them as it prefilled: D answers them
            if kvp.prompt_logprobs is None or len(kvp.prompt_logprobs) != kvp.num_tokens - 1:
                raise bad_request(
                    "the request asks for the prompt's logprobs but kv_transfer_params do not "
                    "carry one entry per prompt token after the first",
                    param="kv_transfer_params",
                )
            prompt_logprobs = [
                (float(lp), int(rank), [(int(t), float(v)) for t, v in top])
                for lp, rank, top in kvp.prompt_logprobs
            ]
        # Raises if it cannot fit; P's prefix-cache hits are what this request's usage reports.
        handle = self.engine.add(
            AdmitRequest(
                kvp.prompt_token_ids,
                options,
                cache_salt,
                every_choice(n, rules, choice_rules),
                kvp.output_token_ids,
                kv_from_elsewhere=True,
                cached_tokens=kvp.cached_tokens,
                priority=priority,
            )
        )
        if prompt_logprobs is not None:
            handle.seq.prompt_logprobs = prompt_logprobs
        try:
            rx = self.manager.create_receiver(kvp)  # its transfer part
        except BaseException:
            self.engine.abort(handle)
            raise
        handle.on_abort = lambda reason: _abort_unless_settled(rx, reason)
        firsts = kvp.first_token_ids or [kvp.first_token_id]
        lps = kvp.first_tokens_logprobs or [kvp.first_token_logprobs] * len(firsts)
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
            for choice, token, lp in zip([handle, *handle.forks], firsts, lps):
                self.engine.accept_token(choice, token, lp)
        except BaseException:  # refused, or the client left during the handshake: tell P
            self.engine.abort(handle, "the decode request ended before the pull")
            raise
        self._spawn(self._pull(handle, rx, len(kvp.page_ids[KV_POOL])))
        return handle

    # The engine's connector (pd/worker/engine/connector.py)

    def waits_for_kv(self, request: AdmitRequest) -> bool:
        return request.kv_from_elsewhere

    def pages_freed(self) -> None:
        self.page_wait.grant()

    def waiting(self) -> tuple[int, int]:
        return len(self.page_wait), self.page_wait.choices

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pull(self, handle: RequestHandle, rx: KVReceiver, num_pages: int) -> None:
        key = f"d-{handle.seq.request_id}"
        try:
            # The wait ends when the pull fails meanwhile (P died or aborted, the lease was
            # lost, or the client left: its abort aborts `rx`), or at the queue's deadline.
            choices = 1 + len(handle.forks)
            pages = await self.page_wait.acquire(key, num_pages, rx.wait, choices)
            if pages is None:
                self._end(handle, rx)
                return
            if all(c.finished for c in [handle, *handle.forks]):  # by the first tokens, or
                # aborted: no pull needed
                rx.abort("request finished before the pull")
                self.engine.give_back(key)
                return
            times = handle.seq.times
            if times is not None:
                times.pages = time.monotonic()
            rx.init({KV_POOL: pages})
            state = await rx.wait()
        except APIError as e:  # no pages within the deadline
            rx.abort(e.message)
            self._count_failure("pages_timeout")
            self.engine.fail(handle, e)
            return
        except BaseException as e:
            rx.abort(f"decode side error: {e!r}")
            self._settle(rx, key)
            if not isinstance(e, asyncio.CancelledError):
                self._count_failure("error")
                log.exception("KV pull of %s failed", handle.seq.request_id)
                self.engine.fail(handle, APIError(500, f"KV pull failed: {e}", "internal_error"))
            raise
        if state is KVPoll.Success and not handle.finished:
            metrics = self.engine.metrics
            if metrics is not None and rx.started_at is not None and rx.finished_at is not None:
                metrics.kv_pull.observe(rx.finished_at - rx.started_at)
                metrics.kv_pull_bytes.inc(num_pages * self.page_bytes)
            if times is not None:
                times.kv_start, times.kv_end = rx.started_at, rx.finished_at
                times.kv_bytes = num_pages * self.page_bytes
            self.engine.kv_arrived(handle, key)
            return
        self._settle(rx, key)
        self._end(handle, rx)

    def _count_failure(self, reason: str) -> None:
        if self.engine.metrics is not None:
            self.engine.metrics.kv_pulls_failed.labels(reason).inc()

    def _end(self, handle: RequestHandle, rx: KVReceiver) -> None:
        """The pull failed (or the request ended meanwhile): fail it if it is still on."""
        if not handle.finished:
            self._count_failure("transfer")
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
        """Free a failed pull's pages, unless a read might still land in them (the transport
        could not cancel it): those are quarantined, never given to another request meanwhile."""
        if rx.dst_unsafe:
            log.error("KV pull %s could not be cancelled: its pages are quarantined", key)
            self.quarantined += 1
            self._spawn(self._quarantine(rx, key))
            return
        self.engine.give_back(key)

    async def _quarantine(self, rx: KVReceiver, key: str) -> None:
        deadline = asyncio.get_running_loop().time() + self.quarantine_s
        while not rx.reclaim():
            if asyncio.get_running_loop().time() >= deadline:
                log.error("KV pull %s: releasing its pages after %ss", key, self.quarantine_s)
                break
            await asyncio.sleep(QUARANTINE_POLL_S)
        self.engine.give_back(key)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await super().stop()


def _abort_unless_settled(rx: KVReceiver, reason: str) -> None:
    if rx.poll() not in (KVPoll.Success, KVPoll.Failed):
        rx.abort(reason)
