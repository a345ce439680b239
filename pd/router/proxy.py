"""The request flow: PD (DESIGN.md §3), decode-local, or co-located, with retries before the
first byte only.

`Proxy.plan` decides before any bytes move: the route, the D picked ahead, and the body each
worker gets. Every phase then tries its workers through one helper, `Proxy.retry` (choose one not
tried, charge it, attempt, go on after a retryable failure, count the retry).

Decode-local (conditional disaggregation, as in Dynamo): when the decode worker the policy picks
is expected (from the router's prefix index) to lack at most `--local-prefill-max-tokens` of the
prompt, it gets the client's body as it is, prefills what it lacks itself and decodes: no P, no
transfer. If it fails before its first byte, the request goes the PD way.

PD: P gets the client's body with `max_tokens=1`, `stream=false` and
`kv_transfer_params={"do_remote_decode": true, "max_tokens": <the client's>}` (P refuses what no
D could take, before prefilling). If P's answer is final (no params, or the client asked for one
token or, with echo, none), it is the answer. The prompt's logprobs, when asked, travel from P to
D in the params (D answers them): the router never merges answers. Else D
gets the client's body plus P's params with `stream=true`; its SSE is relayed byte for byte, or
collected into one JSON answer when the client asked for no stream (so the router still tells
the first token from the end, for TTFT). If D fails before its first byte, P is told to release
the pages (`POST /kv/release`) and the whole P-then-D flow runs again on another D: D's failure
may have aborted the transfer, so P's params cannot be used twice. P is told the same when no D
is healthy, or when the client leaves before D answered.

Deadlines: a prefill gets `--prefill-deadline-base` plus the tokens in flight on its worker over
`--prefill-min-rate` (at most `--prefill-timeout`); a stream `--read-timeout` up to its first
byte, then `--stream-idle-timeout-s` of silence. A worker ejected by the health checks fails its
in-flight requests at once (retried elsewhere when the client has no byte yet).

Disconnects (`is_disconnect`): a worker whose connection breaks before its first byte may have
been crashed by the request (a poison grammar, say), so the router checks its /health at once
(`HealthChecker.recheck`). Failed: the worker is ejected and the client gets a 502
`worker_died`, with no retry, so that one request kills at most one worker. Passed: the phase
tries at most one other worker, never the one that disconnected; a second disconnect anywhere
in the request ends it with a 502 `workers_disconnected`.

After the first byte, a stream that breaks (connection error, EOF before [DONE], ejection,
silence, `: pd-migrate`) migrates: each unfinished choice is continued on another worker by the
usual plan and relayed into the same client stream (migrate.py; docs/migration.md §4).

Every worker picked is charged one in-flight request at once and released in `retry`'s
`finally`, so finish, error and cancellation (a client that goes away cancels the handler, which
closes the upstream connection and so tells the worker) all release it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from time import perf_counter
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web

from pd._compat import asyncio_timeout
from pd.protocol import APIError, error_body
from pd.protocol.names import KV_PARAMS, TOKEN_IDS_HEADER
from pd.protocol.names import SSE_DONE as DONE
from pd.router.answer_size import too_large
from pd.router.config import RouterConfig
from pd.router.exchange import Exchange
from pd.router.failure import JSON, Failure, error_response, json_response
from pd.router.health import HealthChecker
from pd.router.idle import IdleWatch
from pd.router.metrics import RouterMetrics
from pd.router.migrate import Migration, NoRoute, resume
from pd.router.pairing import describe, same_format
from pd.router.prefix_index import answer_bytes
from pd.router.registry import Pool, Registry
from pd.router.sse import SSECollector, StreamError, answer_to_sse, stream_text
from pd.router.tracker import Tracker
from pd.router.worker import Worker
from pd.signing import optional_token
from pd.tracing import NO_TRACING, Tracing

log = logging.getLogger("pd.router")

KV = KV_PARAMS
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_USAGE = {"include_usage": True}  # asked of a stream the router collects, for the answer's usage
R = TypeVar("R")


class _SSEResponse(web.StreamResponse):
    # NOTE: aiohttp's own knob (web.Response sets it too): the headers leave with the first
    # chunk in one write instead of a write of their own. Syscalls are the relay's main cost.
    _send_headers_immediately = False


@dataclass(slots=True, eq=False)
class Plan:
    """What the router does with a request, decided before any bytes move (`Proxy.plan`)."""

    route: str  # "pd": P then D; "local": D alone, then PD if it fails before its first byte;
    # "both": a co-located worker
    stream: dict[str, Any]  # what D or a co-located worker gets (D after P: plus P's params)
    prefill: dict[str, Any] | None = None  # what P gets (routes pd and local)
    decode: Worker | None = None  # the D picked ahead: local's, or the first one PD tries
    final: bool = False  # P's answer is the client's (it asked for one token): no D


def _broken(ex: Exchange, e: BaseException) -> str:
    if ex.timed_out:
        return "the worker's stream was silent for longer than the stream idle timeout"
    if ex.ejected:
        return "the worker was ejected (failed health checks) while it streamed"
    return f"the worker's stream broke off: {type(e).__name__}"


def _reason(ex: Exchange, track: Tracker) -> str:
    """Why a stream broke, as pd_router_migrations_total counts it."""
    if ex.timed_out:
        return "idle"
    if ex.ejected:
        return "ejected"
    return "draining" if track.migrate else "broken"


class Proxy:
    def __init__(
        self,
        cfg: RouterConfig,
        registry: Registry,
        metrics: RouterMetrics,
        health: HealthChecker,
        tracing: Tracing = NO_TRACING,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.health = health
        self.session: aiohttp.ClientSession | None = None  # set in the app's cleanup_ctx
        self.headers = {"Content-Type": JSON}
        if cfg.worker_api_key:
            self.headers["Authorization"] = f"Bearer {cfg.worker_api_key}"
        # No total and no sock_read: a prefill is timed by its deadline, a stream by
        # `asyncio_timeout` up to the first byte, then by the idle watch (see idle.py).
        self.stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout)
        self.idle = IdleWatch(cfg.stream_idle_timeout_s)
        self.release_timeout = aiohttp.ClientTimeout(total=max(1.0, cfg.connect_timeout))
        # Signs the continuations of migrated streams (pd/signing.py); None: sent unsigned.
        self.token = optional_token(cfg.cluster_token)
        self._background: set[asyncio.Future] = set()  # releases sent to P
        # How a broken stream goes on (migrate.py): a leg by the usual plan, and a question to
        # one worker (the usage of a request whose legs never sent it)
        self.tracing = tracing  # --otlp-endpoint's, or off
        self.migration = Migration(
            self._go_on, self._ask, cfg.migration_limit, metrics, self.token, tracing
        )

    @property
    def _client(self) -> aiohttp.ClientSession:
        assert self.session is not None, "Proxy.session is set in the app's cleanup_ctx"
        return self.session

    # ------------------------------------------------------------------------------ plan

    def plan(self, ex: Exchange, route: str) -> Plan:
        """What to do with `ex` on `route` (the registry's: "pd" or "both"), decided before any
        bytes move: decode-local or PD, the D picked ahead, and the body each worker gets."""
        body = ex.facts.body
        # A client without a stream is served from a stream the router collects: one code path
        # on the workers, and a first chunk to time TTFT by.
        stream = body if ex.facts.stream else {**body, "stream": True, "stream_options": _USAGE}
        if route == "both":
            return Plan("both", stream)
        # max_tokens 0 (echo: the prompt and its logprobs alone) stays 0.
        prefill = {**body, "stream": False, "max_tokens": 0 if ex.facts.max_tokens == 0 else 1}
        prefill.pop("stream_options", None)
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        # A client asking one token (or none) gets it from P alone: P keeps no KV for D.
        final = ex.facts.max_tokens in (0, 1)
        if not final:
            prefill[KV] = {"do_remote_decode": True, "max_tokens": ex.facts.max_tokens}
        decode = self.registry.decode
        # The prompt's logprobs need the whole prompt prefilled (no cache hit serves them): P's.
        local = self.cfg.local_prefill_max_tokens and not ex.facts.prompt_logprobs
        d = decode.choose(ex.facts.key, ex.exclude, ex.facts.prompt) if local else None
        if d is not None:
            lacks = self._lacks(decode, d, ex)
            log.debug("decode worker %s lacks ~%d prompt tokens", d.url, lacks)
            if lacks <= self.cfg.local_prefill_max_tokens:
                return Plan("local", stream, prefill, d, final)
        return Plan("pd", stream, prefill, d, final)

    async def _go_on(self, leg: Exchange) -> web.StreamResponse:
        """A migration's leg, by the usual plan."""
        try:
            route = self.registry.route()
        except APIError as e:
            raise NoRoute(e) from e
        return await self.handle(leg, route)

    async def _ask(self, ex: Exchange) -> dict[str, Any] | None:
        """`ex`'s non-streaming answer from one worker that computes prompts (P, or a co-located
        one) not in `ex.exclude`: its JSON, or None when no worker answers."""
        try:
            route = self.registry.route()
        except APIError:
            return None
        pool = self.registry.prefill if route == "pd" else self.registry.both
        w = pool.choose(ex.facts.key, ex.exclude, ex.facts.prompt)
        if w is None or self.session is None:
            return None
        w.acquire(0)
        try:
            async with self.session.post(
                w.url + ex.facts.path,
                data=orjson.dumps(ex.facts.body),
                headers=ex.upstream_headers,
                timeout=self.release_timeout,
            ) as resp:
                data = await resp.read()
            answer = orjson.loads(data) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
            return None
        finally:
            w.release(0)
        return answer if isinstance(answer, dict) else None

    async def handle(self, ex: Exchange, route: str) -> web.StreamResponse:
        """Plan `ex`, then carry the plan out."""
        plan = self.plan(ex, route)
        if plan.route == "both":
            return await self._colocated(ex, plan)
        if plan.route == "local":
            resp = await self._local(ex, plan)
            if resp is not None:
                return resp
        return await self._pd(ex, plan)

    # ------------------------------------------------------------------------------ retry

    async def retry(
        self,
        pool: Pool,
        ex: Exchange,
        attempt: Callable[[Worker], Awaitable[R | Failure]],
        *,
        charge: Callable[[Worker], int] | None = None,
        first: Worker | None = None,
        tries: int | None = None,
        before: Callable[[], Awaitable[R | None]] | None = None,
        fits: Callable[[Worker], bool] | None = None,
    ) -> R | Failure:
        """Every phase's tries: choose a worker of `pool` not tried yet (`first` while it is
        healthy, else the policy's pick), charge it `charge(w)` prompt tokens while
        `attempt(w)` runs, and after a failure another worker could mend (`Failure.retryable`)
        go on to the next, counted in pd_router_retries_total; at most `tries` tries
        (--max-retries + 1). `before` runs ahead of each choice and may end the phase with its
        result: in PD, each try of D follows a prefill of its own. Returns what `attempt`
        returned, or the failure the client gets. Only workers that `fits` takes are
        chosen (after `before`): in PD, a D whose runtime format is its P's (pairing.py).

        After a disconnect (`Failure.disconnect`: the request may have crashed the worker) at
        most one more try follows, and that worker is never chosen again for the request; a
        request's second disconnect (in any phase) ends it: a 502 `workers_disconnected`. A
        worker that disconnected and then failed a health check ends the phase at once (its
        failure is not retryable: `_on_error`)."""
        tried: list[Worker] = [w for w in (*ex.exclude, *ex.disconnected) if w.role == pool.name]
        failure: Failure | None = None
        last: int | None = None  # the last try allowed after a disconnect
        for n in range(self.cfg.max_retries + 1 if tries is None else tries):
            if last is not None and n > last:
                break
            if before is not None:
                done = await before()
                if done is not None:
                    return done
            unfit = [] if fits is None else [x for x in pool.healthy if not fits(x)]
            skip = tried + unfit
            if n == 0 and first is not None and first in pool.healthy and first not in skip:
                w: Worker | None = first
            else:
                w = pool.choose(ex.facts.key, skip, ex.facts.prompt)
            if w is None:
                if unfit and not tried:
                    return self._no_pair(pool)
                break
            if n:
                self.metrics.retries[pool.name] += 1
            tried.append(w)
            tokens = charge(w) if charge is not None else 0
            self._trace_try(pool, ex, w, n)
            w.acquire(tokens)
            try:
                result = await attempt(w)
            finally:
                w.release(tokens)
            if not isinstance(result, Failure):
                return result
            failure = result
            if failure.disconnect and failure.retryable:  # it still answers /health
                ex.disconnected += (w,)
                if len(ex.disconnected) > 1:
                    return self._disconnected_twice(ex)
                last = n + 1
            if not failure.retryable:
                break
        return failure or self._no_worker(pool, tried)

    def _trace_try(self, pool: Pool, ex: Exchange, w: Worker, n: int) -> None:
        """A traced request's try of `w`: the worker and policy on its span (a retry as an
        event), and the W3C headers that make the worker's spans its children. One span a
        request at the router (a span a call cost a third of its throughput at c=64)."""
        span = ex.span
        if not span.recording:
            return
        span.set_many({f"pd.{pool.name}.worker": w.url, f"pd.{pool.name}.policy": pool.policy.name})
        if n:
            span.event("retry", {"pd.pool": pool.name, "pd.worker": w.url, "pd.try": n})
        if ex.trace_headers is None:
            ex.trace_headers = self.tracing.headers(span)

    # ------------------------------------------------------------------------------ flows

    async def _pd(self, ex: Exchange, plan: Plan) -> web.StreamResponse:
        """P, then D with P's params; each try of D after a prefill of its own (D's failure may
        have aborted P's transfer, so P's params are never sent to a second D)."""
        assert plan.prefill is not None
        prefill, decode = self.registry.prefill, self.registry.decode
        p_attempt = partial(self._prefill_once, ex, orjson.dumps(plan.prefill))

        def p_charge(w: Worker) -> int:  # what P is expected to compute: the prompt less its hit
            expected = prefill.expected_cached_bytes(w, ex.facts.prompt)
            return max(1, ex.facts.tokens - prefill.estimate.tokens(expected))

        held: tuple[Worker, Any] | None = None  # P and its params, until a D try takes them

        async def prefilled() -> web.StreamResponse | None:
            nonlocal held
            t = perf_counter()
            # a P that some healthy D can pair with (pairing.py)
            got = await self.retry(
                prefill, ex, p_attempt, charge=p_charge,
                fits=lambda p: any(same_format(p, d) for d in decode.healthy),
            )  # fmt: skip
            if isinstance(got, Failure):
                return got.response()
            p, answer = got
            self.metrics.prefill.observe(perf_counter() - t)
            params = answer.pop(KV, None)
            if plan.final or not params:  # final on P (EOS, a stop, or the client's max_tokens 1)
                return self._final(ex, answer)
            held = (p, params)
            return None

        async def d_attempt(w: Worker) -> web.StreamResponse | Failure:
            nonlocal held
            assert held is not None
            (p, params), held = held, None  # this try owns P's pages now
            try:
                opened = await self._open(decode, w, ex, orjson.dumps({**plan.stream, KV: params}))
            except BaseException:  # the client left before D answered
                self._release_prefill(p, params, "the client left before the decode worker")
                raise
            if isinstance(opened, Failure):
                self._release_prefill(p, params, f"decode worker {w.url} answered {opened.status}")
                return opened
            return await self._serve(decode, w, ex, *opened)

        first = plan.decode if plan.route == "pd" else None  # local's D failed: any D

        def pairs(d: Worker) -> bool:  # a D on its P's runtime format
            return held is None or same_format(held[0], d)

        served = await self.retry(decode, ex, d_attempt, first=first, before=prefilled, fits=pairs)
        if isinstance(served, Failure):
            if held is not None:  # prefilled, and no D left to try
                self._release_prefill(*held, "no healthy decode worker to pull it")
            return served.response()
        return served

    def _final(self, ex: Exchange, answer: dict[str, Any]) -> web.Response:
        """P's answer is the client's: as JSON, or as the SSE events a stream would carry."""
        ex.ttft = perf_counter() - ex.t0
        if not ex.facts.stream:
            return json_response(answer)
        return web.Response(
            body=answer_to_sse(answer, ex.facts.chat, ex.facts.include_usage), headers=SSE_HEADERS
        )

    def _release_read_answer(self, p: Worker, data: bytes | None, reason: str) -> None:
        """P's answer was read but is dropped (the phase ended on closing its connection):
        release what it pinned, if anything."""
        if data is None:
            return
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if isinstance(answer, dict):
            self._release_prefill(p, answer.get(KV), reason)

    def _release_prefill(self, p: Worker, params: Any, reason: str) -> None:
        """Tell P to drop the pages it pinned for these params: no D will pull them."""
        tid = params.get("transfer_id") if isinstance(params, dict) else None
        if not isinstance(tid, str):
            return
        self.metrics.prefill_releases += 1
        task = asyncio.ensure_future(self._post_release(p, tid, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_release(self, p: Worker, transfer_id: str, reason: str) -> None:
        body = orjson.dumps({"transfer_id": transfer_id, "reason": reason})
        try:
            async with self._client.post(
                p.url + "/kv/release", data=body, headers=self.headers, timeout=self.release_timeout
            ) as resp:
                answer = await resp.read()
            if resp.status == 200:
                return
            why = f"it answered {resp.status}: {answer[:200].decode(errors='replace')}"
        except (aiohttp.ClientError, TimeoutError) as e:
            why = f"{type(e).__name__} {e}".strip()
        # P keeps those pages pinned until its lease runs out: capacity lost meanwhile, and a
        # sign of a P that cannot release (or an incompatible one), so it must show.
        self.metrics.prefill_release_failures += 1
        log.warning(
            "could not release transfer %s on %s (its lease frees it later): %s",
            transfer_id,
            p.url,
            why,
        )

    def _lacks(self, pool: Pool, w: Worker, ex: Exchange) -> int:
        """Estimated prompt tokens `w` would have to prefill itself."""
        cached = pool.expected_cached_bytes(w, ex.facts.prompt)
        return pool.estimate.tokens(len(ex.facts.prompt.data) - cached)

    async def _local(self, ex: Exchange, plan: Plan) -> web.StreamResponse | None:
        """Decode-local: D prefills and decodes; None when it failed before its first byte."""
        pool = self.registry.decode
        attempt = partial(self._stream_once, pool, ex, orjson.dumps(plan.stream), "local")
        served = await self.retry(pool, ex, attempt, first=plan.decode, tries=1)
        if isinstance(served, Failure):
            if served.disconnect and not served.retryable:  # D died: P is not tried either
                return served.response()
            self.metrics.local_fallbacks += 1
            log.info(
                "decode-local request failed on %s (%s): going through P",
                plan.decode.url if plan.decode else None,
                served,
            )
            return None
        return served

    async def _colocated(self, ex: Exchange, plan: Plan) -> web.StreamResponse:
        pool = self.registry.both
        attempt = partial(self._stream_once, pool, ex, orjson.dumps(plan.stream), None)
        served = await self.retry(pool, ex, attempt)
        return served.response() if isinstance(served, Failure) else served

    # ------------------------------------------------------------------------------ attempts

    async def _prefill_once(
        self, ex: Exchange, payload: bytes, w: Worker
    ) -> tuple[Worker, dict[str, Any]] | Failure:
        """One try of P (charged by `retry`): its answer, and which P gave it."""
        pool = self.registry.prefill
        expected = pool.expected_cached_bytes(w, ex.facts.prompt)
        # Its deadline grows with the tokens ahead of it on that worker (its own included).
        deadline = min(
            self.cfg.prefill_timeout,
            self.cfg.prefill_deadline_base + w.inflight_tokens / self.cfg.prefill_min_rate,
        )
        data: bytes | None = None  # P's answer, once read
        try:
            async with _Deadline(w, deadline):
                async with self._client.post(
                    w.url + ex.facts.path,
                    data=payload,
                    headers=ex.upstream_headers,
                    timeout=self.stream_timeout,
                ) as resp:
                    data = await resp.read()
            if resp.status != 200:
                return Failure.upstream(w, resp, data)
            try:
                answer = orjson.loads(data)
            except orjson.JSONDecodeError:
                answer = None
            if not isinstance(answer, dict):
                return Failure.local(
                    502, f"prefill worker {w.url} answered no JSON object", "prefill_failed"
                )
            self._learn(pool, w, ex, ex.facts.prompt.blocks, expected, answer.get("usage"))
            return w, answer
        except TimeoutError:
            self._release_read_answer(w, data, "the prefill's deadline ran out")
            return self._timed_out(w, f"did not answer within {deadline:.1f}s")
        except aiohttp.ClientError as e:
            self._release_read_answer(w, data, "the prefill's connection broke")
            return await self._on_error(w, e)
        except asyncio.CancelledError:  # the client left, maybe with P's answer read
            self._release_read_answer(w, data, "the client left before the decode worker")
            raise

    async def _stream_once(
        self, pool: Pool, ex: Exchange, payload: bytes, route: str | None, w: Worker
    ) -> web.StreamResponse | Failure:
        """One try of a streaming worker (charged by `retry`); `route` is what the request is
        counted as once `w` answered (None: the registry's)."""
        opened = await self._open(pool, w, ex, payload)
        if isinstance(opened, Failure):
            return opened
        if route is not None:
            ex.route = route
        return await self._serve(pool, w, ex, *opened)

    # ------------------------------------------------------------------------------ relay

    async def _open(
        self, pool: Pool, w: Worker, ex: Exchange, payload: bytes
    ) -> tuple[aiohttp.ClientResponse, bytes] | Failure:
        """POST to `w` and read its first chunk; on failure the response is closed and the
        failure returned."""
        resp = None
        handed_over = False
        try:
            async with _Deadline(w, self.cfg.read_timeout):  # up to the first byte
                resp = await self._client.post(
                    w.url + ex.facts.path,
                    data=payload,
                    headers={**ex.upstream_headers, TOKEN_IDS_HEADER: "1"},
                    timeout=self.stream_timeout,
                )
                if resp.status != 200:
                    return Failure.upstream(w, resp, await resp.read())
                first = await resp.content.readany()
            if not first:
                return Failure.local(
                    502, f"{pool.name} worker {w.url} sent an empty answer", f"{pool.name}_failed"
                )
            handed_over = True
            return resp, first
        except TimeoutError:
            return self._timed_out(w, f"sent nothing within {self.cfg.read_timeout}s")
        except aiohttp.ClientError as e:
            return await self._on_error(w, e)
        finally:
            if not handed_over and resp is not None:
                resp.close()

    async def _serve(
        self, pool: Pool, w: Worker, ex: Exchange, resp: aiohttp.ClientResponse, first: bytes
    ) -> web.StreamResponse:
        """Relay an opened answer: from here on there is no retry."""
        # A PD decode answer reports P's cache hits: only local and co-located ones are this
        # worker's own, to hold against what the index expected.
        own = pool.name != "decode" or ex.route == "local"
        expected = pool.expected_cached_bytes(w, ex.facts.prompt) if own else None
        # Chat answers come back as the next turn's assistant message, so a worker that
        # generated one holds the KV of the conversation so far: the relayed stream is kept (up
        # to --prefix-index-answer-bytes) and read back for the index. (A completion's prompt
        # rarely grows by its own answer: its prompt alone is recorded, its stream not kept.)
        keep = self.cfg.prefix_index_answer_bytes if pool.index.enabled and ex.facts.chat else 0
        self.idle.watch(ex, resp)

        def ejected() -> None:  # the pending read fails: the relay ends the stream with an error
            ex.ejected = True
            resp.close()

        w.cancels.add(ejected)
        ex.track = Tracker(w, partial(self._drained, pool, w))

        def learn(text: str | None, usage: Any) -> None:
            blocks = ex.facts.prompt.blocks
            answer = answer_bytes(text, ex.facts.chat) if text and ex.facts.chat else b""
            if answer and len(answer) <= self.cfg.prefix_index_answer_bytes:
                blocks = ex.facts.prompt.extended(answer)
            self._learn(pool, w, ex, blocks, expected, usage)

        def learn_stream(read: _StreamRead) -> None:
            chunks, read.chunks = read.chunks, None
            text = stream_text(b"".join(chunks)) if chunks else None
            learn(*(text or (None, None)))

        try:
            if ex.facts.stream:
                # Learnt before the stream's last bytes leave: the client's next turn may be
                # routed as soon as they arrive.
                return await self._pipe(ex, resp, first, _StreamRead(keep), learn_stream)
            out, answer = await self._collect(ex, resp, first)
            if answer is not None:
                learn(_answer_text(answer, ex.facts.chat), answer.get("usage"))
            return out
        finally:
            w.cancels.discard(ejected)
            self.idle.unwatch(ex)
            resp.close()  # a no-op once the body was read to its end

    def _learn(
        self,
        pool: Pool,
        w: Worker,
        ex: Exchange,
        blocks: list[int],
        expected_bytes: int | None,
        usage: Any,
    ) -> None:
        """After a good answer: `w` now holds `blocks`; its usage calibrates the token estimate
        and says how many prompt tokens it actually had cached, against what was expected."""
        pool.record(w, blocks)
        if not isinstance(usage, dict):
            return
        prompt_tokens = usage.get("prompt_tokens")
        if isinstance(prompt_tokens, int):
            pool.estimate.observe(len(ex.facts.prompt.data), prompt_tokens)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if expected_bytes is not None and isinstance(cached, int):
            self.metrics.cached_tokens(pool.name, pool.estimate.tokens(expected_bytes), cached)

    async def _pipe(
        self,
        ex: Exchange,
        upstream: aiohttp.ClientResponse,
        first: bytes,
        read: _StreamRead,
        complete: Callable[[_StreamRead], None],
    ) -> web.StreamResponse:
        """Relay the stream (less its `: pd-` lines: `Tracker.feed`); `complete(read)` runs once
        it has all come and ended well ([DONE], no error event), before its end goes out. A
        stream that did not is not learnt from: the worker may hold nothing of it. A stream that
        breaks before [DONE] migrates (`_broke`)."""
        resp = _SSEResponse(headers=SSE_HEADERS) if ex.sink is None else ex.sink
        content = upstream.content
        track = ex.track
        assert track is not None, "_serve sets the tracker"
        try:
            await resp.prepare(ex.request)
            # `complete()` runs before the client can see the stream's end: its last event.
            data = track.feed(first)
            if read.feed(data):
                complete(read)
            if content.at_eof() and read.done:  # the whole stream at once: one write
                await resp.write_eof(data)
                ex.ttft = perf_counter() - ex.t0
                return resp
            if data:
                await resp.write(data)
            ex.ttft = perf_counter() - ex.t0
            async for chunk in content.iter_any():
                ex.reads += 1
                data = track.feed(chunk)
                if read.feed(data):
                    complete(read)
                if read.done and content.at_eof():  # the last bytes go with the body's end
                    await resp.write_eof(data)
                    return resp
                if data:
                    await resp.write(data)
            if not (read.done or read.error):  # EOF before [DONE]
                reason = "draining" if track.migrate else "eof"
                return await self._broke(ex, upstream, resp, track, reason)
        except ConnectionResetError:  # the client went away; the caller closes the upstream
            ex.status = "499"
            return resp
        except aiohttp.ClientError as e:
            if read.error:  # the worker said what went wrong: that ends it
                ex.status = "stream_error"
                with contextlib.suppress(ConnectionResetError):
                    await resp.write_eof()
                return resp
            return await self._broke(ex, upstream, resp, track, _reason(ex, track), _broken(ex, e))
        with contextlib.suppress(ConnectionResetError):  # it had the whole stream, then left
            await resp.write_eof()
        return resp

    async def _broke(
        self,
        ex: Exchange,
        upstream: aiohttp.ClientResponse,
        resp: web.StreamResponse,
        track: Tracker,
        reason: str,
        why: str = "the worker's stream ended before [DONE]",
    ) -> web.StreamResponse:
        """The stream broke after bytes reached the client: continue it elsewhere (a leg of a
        migration only says why it broke: `resume` goes on), else end it with an error event."""
        if ex.leg:
            ex.broken = reason
            return resp
        self._let_go(ex, upstream)
        try:
            out = await resume(self.migration, ex, track, resp.write, reason)
        except ConnectionResetError:
            out = None
        if out is None or out.gone:
            ex.status = "499"
            return resp
        with contextlib.suppress(ConnectionResetError):  # the client may be gone too
            if out.ok:
                if out.usage is not None and ex.facts.include_usage:
                    await resp.write(_usage_event(out.head, ex.facts.chat, out.usage))
                await resp.write_eof(DONE)
                return resp
            ex.status = "stream_error"
            if out.error is None:  # (a leg's error event went out already)
                if out.why:
                    why = f"{why}; {out.why}"
                body = error_body(why, "upstream_error", "stream_broken")
                await resp.write(b"data: " + orjson.dumps(body) + b"\n\n")
            await resp.write_eof()
        return resp

    def _let_go(self, ex: Exchange, upstream: aiohttp.ClientResponse) -> None:
        """The broken stream is done with while its continuation runs: closed, not watched."""
        self.idle.unwatch(ex)
        upstream.close()

    def _drained(self, pool: Pool, w: Worker) -> None:
        """`: pd-migrate`: the worker drains; no new request goes to it from now on."""
        pool.set_draining(w)

    async def _collect(
        self, ex: Exchange, upstream: aiohttp.ClientResponse, first: bytes
    ) -> tuple[web.StreamResponse, dict[str, Any] | None]:
        """The stream as one JSON answer, and that answer (None when the stream failed). A
        stream that breaks before [DONE] migrates, its continuation collected too."""
        ex.ttft = perf_counter() - ex.t0
        limit = ex.answer_limit or self.cfg.max_answer_bytes
        collector = SSECollector(ex.facts.chat, limit)
        track = ex.track
        assert track is not None, "_serve sets the tracker"
        reason: str | None = None
        why = "the decode stream ended before [DONE]"
        try:
            collector.feed(track.feed(first))
            async for chunk in upstream.content.iter_any():
                ex.reads += 1
                collector.feed(track.feed(chunk))
                if collector.overflow:  # (the caller closes the stream: the worker aborts)
                    return error_response(too_large(limit)), None
            if not collector.done:
                reason = "draining" if track.migrate else "eof"
        except StreamError as e:
            return json_response(e.body, 502), None
        except aiohttp.ClientError as e:
            reason, why = _reason(ex, track), _broken(ex, e)
        except ValueError:  # bad JSON (orjson's JSONDecodeError is one), or no JSON object
            failure = Failure.local(502, "the decode stream carried bad JSON", "bad_stream")
            return failure.response(), None
        if reason is not None:
            self._let_go(ex, upstream)

            async def emit(data: bytes) -> None:
                collector.feed(data)

            try:
                out = await resume(self.migration, ex, track, emit, reason)
            except StreamError as e:
                return json_response(e.body, 502), None
            except ValueError:
                failure = Failure.local(502, "the decode stream carried bad JSON", "bad_stream")
                return failure.response(), None
            if out.error is not None:
                return json_response(out.error, 502), None
            if not out.ok:
                if out.gone:
                    ex.status = "499"
                why = f"{why}; {out.why}" if out.why else why
                return Failure.local(502, why, "stream_broken").response(), None
            if collector.overflow:  # (a continuation's events past the limit were dropped)
                return error_response(too_large(limit)), None
            if out.usage is not None:
                collector.feed(_usage_event(out.head, ex.facts.chat, out.usage))
            collector.feed(DONE)
        answer = collector.result()
        return json_response(answer), answer

    # ------------------------------------------------------------------------------ errors

    def _timed_out(self, w: Worker, what: str) -> Failure:
        """A deadline ran out, or the worker was ejected meanwhile (which expires it at once)."""
        phase = w.role if w.role != "both" else "worker"
        if not w.healthy:
            return Failure.local(
                502, f"{w.role} worker {w.url} was ejected: {w.last_error}", f"{phase}_failed"
            )
        return Failure.local(504, f"{w.role} worker {w.url} {what}", f"{phase}_timeout")

    async def _on_error(self, w: Worker, e: aiohttp.ClientError) -> Failure:
        """A request to `w` failed with `e` before the client got a byte. A connect error
        ejects `w` at once. A disconnect (`is_disconnect`) is followed by a health check of `w`
        right away (shared with the other requests `w` broke meanwhile): if it fails, `w` is
        ejected and the failure is not retryable (the request may have crashed `w`: it is
        not sent on to crash another); if it passes, the failure is retryable, marked as a
        disconnect (`retry` tries one other worker at most). Counted in
        pd_router_disconnects_total{pool,outcome}."""
        phase = w.role if w.role != "both" else "worker"
        error = f"{type(e).__name__} {e}".strip()
        if is_disconnect(e):
            why = await self.health.recheck(w)
            if why is not None:
                self.metrics.disconnects[w.role, "dead"] += 1
                self.health.eject(w, f"it disconnected during a request, then {why}")
                log.warning(
                    "%s worker %s disconnected before its first byte (%s), then %s: ejected; "
                    "the request is not retried (it may have crashed the worker)",
                    w.role,
                    w.url,
                    error,
                    why,
                )
                return Failure.local(
                    502,
                    f"{w.role} worker {w.url} disconnected before answering ({error}) and then "
                    f"failed a health check ({why}): the request may have crashed it, so it "
                    "was not retried on another worker",
                    "worker_died",
                    retryable=False,
                    disconnect=True,
                )
            self.metrics.disconnects[w.role, "alive"] += 1
            log.info(
                "%s worker %s disconnected before its first byte (%s); its /health answers",
                w.role,
                w.url,
                error,
            )
            return Failure.local(
                502,
                f"{w.role} worker {w.url} disconnected before answering ({error})",
                f"{phase}_failed",
                disconnect=True,
            )
        if isinstance(e, aiohttp.ClientConnectorError):
            self.health.eject(w, f"cannot connect: {e}")
        return Failure.local(502, f"{w.role} worker {w.url} failed: {error}", f"{phase}_failed")

    def _disconnected_twice(self, ex: Exchange) -> Failure:
        """The request's second disconnect (both workers passed a health check after it)."""
        first, second = ex.disconnected[-2:]
        log.warning(
            "a request disconnected two workers before their first byte (%s %s, then %s %s): "
            "not retried again",
            first.role,
            first.url,
            second.role,
            second.url,
        )
        return Failure.local(
            502,
            f"the request disconnected two workers before they answered ({first.role} worker "
            f"{first.url}, then {second.role} worker {second.url}); both still answer their "
            "health checks, but the request may be what breaks them, so it was not retried "
            "again",
            "workers_disconnected",
            retryable=False,
            disconnect=True,
        )

    def _no_pair(self, pool: Pool) -> Failure:
        """Healthy workers of `pool`, none on the format of the other side of the pair."""
        self.metrics.unpaired_refusals += 1
        sides = "; ".join(
            f"the {p.name} workers run "
            + (" | ".join(sorted({describe(w.runtime_format) for w in p.healthy})) or "nothing")
            for p in (self.registry.prefill, self.registry.decode)
        )
        body = error_body(
            f"no healthy {pool.name} worker computes in the format of a worker of the other side "
            f"of the pair ({sides}): P and D must run one model",
            "service_unavailable",
            "no_paired_worker",
        )
        return Failure(503, orjson.dumps(body), retry_after="1")

    def _no_worker(self, pool: Pool, tried: list[Worker]) -> Failure:
        if tried:
            return Failure.local(
                502, f"every {pool.name} worker tried failed", f"{pool.name}_failed"
            )
        body = error_body(
            f"no healthy {pool.name} worker", "service_unavailable", "no_healthy_worker"
        )
        return Failure(503, orjson.dumps(body), retry_after="1")


def is_disconnect(e: BaseException) -> bool:
    """Whether `e` says that a worker's connection broke after it was made, before the router
    had the worker's whole answer (P) or its first byte (a stream): the worker closed or reset
    it (ServerDisconnectedError; ClientOSError other than a connect error, e.g. ECONNRESET or
    EPIPE; ClientConnectionResetError; aiohttp's plain ClientConnectionError "Connection lost")
    or cut its answer short (ClientPayloadError). A worker that the request crashed looks like
    this (so does one killed, or restarted, meanwhile). Not a disconnect: a connect error
    (ClientConnectorError: no connection was made), a timeout (ServerTimeoutError), a TLS
    fingerprint mismatch, a malformed answer (ClientResponseError: the worker did answer) or a
    bad URL."""
    if isinstance(e, aiohttp.ClientPayloadError):
        return True
    return isinstance(e, aiohttp.ClientConnectionError) and not isinstance(
        e,
        (
            aiohttp.ClientConnectorError,
            aiohttp.ServerTimeoutError,
            aiohttp.ServerFingerprintMismatch,
        ),
    )


_ERROR_EVENT = b'data: {"error"'
_DONE_AT = -len(DONE)
# What a kept chunk costs beyond its bytes (the bytes object and its list slot), so that a
# stream of tiny chunks is bounded too.
_CHUNK_OVERHEAD = 48


class _StreamRead:
    """What the router reads of a stream it relays, chunk by chunk, for the prefix index:
    whether it ended well (its last event [DONE], and no error event before) and, while they fit
    in `keep` bytes, its chunks (to read the answer back). A longer stream is dropped: its
    prompt alone is learnt. It is fed what `Tracker.feed` relays: whole events, so that neither
    an error event nor [DONE] is ever cut between chunks. Per chunk: one scan for an error
    event, nothing copied."""

    __slots__ = ("chunks", "room", "error", "done")

    def __init__(self, keep: int) -> None:
        self.chunks: list[bytes] | None = [] if keep > 0 else None
        self.room = keep
        self.error = False
        self.done = False

    def feed(self, chunk: bytes) -> bool:
        """Take the next whole events; True once, when the stream just ended well."""
        if chunk.partition(_ERROR_EVENT)[1]:  # (not `in`: see Tracker.feed)
            self.error = True
        if self.chunks is not None:
            self.room -= len(chunk) + _CHUNK_OVERHEAD
            if self.room < 0:
                self.chunks = None  # too long to keep: learn the prompt only
            else:
                self.chunks.append(chunk)
        if self.done or self.error or chunk[_DONE_AT:] != DONE:
            return False
        self.done = True
        return True


class _Deadline:
    """`asyncio_timeout(seconds)`, which also expires at once when `w` is ejected (a plain class:
    it is on every request's path, twice)."""

    __slots__ = ("w", "cm")

    def __init__(self, w: Worker, seconds: float) -> None:
        self.w = w
        self.cm = asyncio_timeout(seconds)

    def __call__(self) -> None:  # `w` was ejected
        self.cm.reschedule(asyncio.get_running_loop().time())

    async def __aenter__(self) -> None:
        await self.cm.__aenter__()
        self.w.cancels.add(self)

    async def __aexit__(self, *exc: Any) -> None:
        self.w.cancels.discard(self)
        await self.cm.__aexit__(*exc)


def _usage_event(head: dict[str, Any], chat: bool, usage: dict[str, Any]) -> bytes:
    obj = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    return b"data: " + orjson.dumps({**obj, "choices": [], "usage": usage}) + b"\n\n"


def _answer_text(answer: dict[str, Any], chat: bool) -> str | None:
    choices = answer.get("choices") or ()
    if not choices or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    text = (c.get("message") or {}).get("content") if chat else c.get("text")
    return text if isinstance(text, str) else None


__all__ = ["DONE", "Exchange", "Plan", "Proxy", "json_response"]
