"""The worker's HTTP face: OpenAI endpoints, /v1/models, /health, /metrics (aiohttp, orjson)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from pd.cors import enable_cors
from pd.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationOptions,
    bad_request,
    error_body,
    header_bytes,
    parse_json_body,
    require_json,
)
from pd.protocol.names import (
    CONTINUATION,
    KV_PARAMS,
    SIG,
    SSE_DONE,
    SSE_KEEPALIVE,
    SSE_MIGRATE,
    TOKEN_IDS_HEADER,
)
from pd.signing import continuation_payload, unsigned
from pd.worker.api.choices import choices_of, collect, interleave, usage
from pd.worker.api.echo import PromptPart, once, prompt_part
from pd.worker.api.openai_format import (
    KEEPALIVE_S,
    ResponseBuilder,
    sse,
)
from pd.worker.api.prompt import PromptBuilder, Request
from pd.worker.api.spans import record_request
from pd.worker.api.tokenize import check_model, detokenize, tokenize
from pd.worker.build import Worker
from pd.worker.engine import RequestHandle
from pd.worker.readiness import TICK_S, Readiness
from pd.worker.text.grammar import GrammarCompiler, GrammarError, GrammarUnavailable
from pd.worker.text.token_rules import TokenRules, rules_for
from pd.worker.tools import ToolCalling

log = logging.getLogger(__name__)

WORKER = web.AppKey("worker", Worker)
PROMPTS = web.AppKey("prompts", PromptBuilder)
GRAMMARS = web.AppKey("grammars", GrammarCompiler)
READINESS = web.AppKey("readiness", Readiness)
TOOLS = web.AppKey("tools", ToolCalling)
BODY_LIMIT = web.AppKey("body_limit", int)
TOKEN_TEXT = web.AppKey[Callable[[int], str]]("token_text")  # a token's text, cached by id
# An echoed prompt or prompt logprobs of this many entries (positions x alternatives) or more are
# rendered on the text thread: on the event loop they would stall every stream (EXPERIMENTS §23).
LARGE_PROMPT_PART = 4096


LARGE_ANSWER_BYTES = 1 << 20  # an answer this large is written a slice at a time
ANSWER_SLICE_BYTES = 256 << 10


async def send_json(request: web.Request, data: bytes) -> web.StreamResponse:
    """A JSON answer already serialized. A large one goes out a slice at a time: handing the
    transport megabytes at once holds the event loop for as long as it copies them
    (docs/EXPERIMENTS.md §16, `pd-bench stall --kinds tokenize`)."""
    if len(data) < LARGE_ANSWER_BYTES:
        return web.Response(body=data, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.content_length = len(data)
    await resp.prepare(request)
    view = memoryview(data)
    for i in range(0, len(data), ANSWER_SLICE_BYTES):
        await resp.write(view[i : i + ANSWER_SLICE_BYTES])
    await resp.write_eof()
    return resp


def json_response(body: object, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        require_json(request.method, request.body_exists, request.content_type)
        return await handler(request)
    except APIError as e:
        return json_response(e.body(), e.status, e.headers)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[BODY_LIMIT]
        message = (
            f"the request body is larger than {limit} bytes, more than any request within this "
            "model's context takes"
        )
        return json_response(error_body(message, code="request_too_large"), 413)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_response(error_body(e.reason, "invalid_request_error", str(e.status)), e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("unhandled error on %s", request.path)
        return json_response(error_body(f"internal error: {e}", "internal_error"), 500)


def make_app(worker: Worker) -> web.Application:
    prompts = PromptBuilder(
        worker.tokenizer, worker.engine.max_model_len, worker.config.ignore_unknown_fields
    )
    # A body no prompt that fits could fill is refused before it is read whole or parsed
    # (orjson holds the GIL while it parses: EXPERIMENTS §23).
    limit = worker.config.max_body_bytes or worker.role.body_limit(
        prompts.max_body_bytes, worker.engine.max_model_len
    )
    app = web.Application(middlewares=[errors_middleware], client_max_size=limit)
    app[WORKER] = worker
    app[PROMPTS] = prompts
    app[READINESS] = readiness = Readiness(
        starting_until=time.monotonic() + worker.startup_s if worker.startup_s else 0.0
    )
    readiness.parked = worker.config.park
    app[GRAMMARS] = GrammarCompiler(
        worker.tokenizer,
        worker.vocab_size or worker.tokenizer.vocab_size,
        worker.config.grammar_timeout_s,
        children=worker.config.grammar_compilers,
        memory_mb=worker.config.grammar_memory_mb,
        cache_bytes=worker.config.grammar_cache_mb << 20,
    )
    app[TOOLS] = ToolCalling(worker.tokenizer.chat_template, worker.config.tool_call_parser)
    app[BODY_LIMIT] = limit
    tokenizer = worker.tokenizer

    @functools.lru_cache(maxsize=1 << 18)
    def token_text(t: int) -> str:
        return tokenizer.decode([t], False)

    text_of: Callable[[int], str] = token_text
    app[TOKEN_TEXT] = text_of
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/integrity", integrity)
    app.router.add_get("/steps", steps)
    if worker.config.park:
        app.router.add_post("/activate", activate)
        app.router.add_post("/park", park)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    for path, serve in worker.role.routes().items():  # the role's own
        app.router.add_post(path, _role_route(serve))
    app.router.add_post("/tokenize", tokenizer_endpoint)
    app.router.add_post("/detokenize", tokenizer_endpoint)
    enable_cors(app, worker.config.allowed_origins)
    app.cleanup_ctx.append(_engine_ctx)
    if worker.transfer is not None:
        app.cleanup_ctx.append(_transfer_ctx)
    return app


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    engine = app[WORKER].engine
    engine.trace_times = app[WORKER].tracing.enabled
    engine.start()
    ticker = asyncio.create_task(_tick_readiness(app))
    role = asyncio.create_task(app[WORKER].role.run())  # decode: its prefill peers' watch
    yield
    ticker.cancel()
    role.cancel()
    await asyncio.gather(role, return_exceptions=True)  # its finally: sessions closed
    await engine.stop()
    await asyncio.to_thread(app[WORKER].tracing.shutdown)  # the last spans out (<= 5 s)
    app[PROMPTS].close()
    await app[GRAMMARS].aclose()


def _admit_blocker(app: web.Application) -> str | None:
    """What keeps this worker from admitting any request now (readiness.py), or None."""
    blocker = app[WORKER].engine.admit_blocker()
    return blocker or app[GRAMMARS].pool.down


async def _tick_readiness(app: web.Application) -> None:
    readiness = app[READINESS]
    while True:
        try:
            readiness.update(time.monotonic(), _admit_blocker(app))
        except Exception:  # never frozen: the next tick tries again
            log.exception("readiness: the admission check failed")
        await asyncio.sleep(TICK_S)


async def ready(request: web.Request) -> web.Response:
    """Readiness (readiness.py): 200 while this worker should get new requests, else 503 and
    why (draining, or unable to admit any for 2 s)."""
    worker = request.app[WORKER]
    ok, why = request.app[READINESS].state(worker.draining)
    body = {"ready": ok, "reason": why} if not ok else {"ready": True}
    return json_response(body, 200 if ok else 503)


async def steps(request: web.Request) -> web.Response:
    """The step record (engine/step_log.py) for the planner: totals, and the decode steps after
    `?after=N` (a step index from an earlier answer's `steps`)."""
    raw = request.query.get("after", "0")
    if not raw.isdigit():
        raise bad_request("'after' must be a step index (a non-negative integer)", "after")
    worker = request.app[WORKER]
    body = worker.engine.step_log.since(int(raw))
    body["role"] = worker.role.name
    return json_response(body)


async def activate(request: web.Request) -> web.Response:
    """`--park`: this spare node is wanted. Its start-up (`--startup-s`) begins, and it
    registers with its router (`--register-with`); a second call changes nothing."""
    worker = request.app[WORKER]
    _check_auth(worker, request)
    readiness = request.app[READINESS]
    if readiness.parked:
        readiness.activate(time.monotonic(), worker.startup_s)
        if worker.on_activate is not None:
            worker.on_activate()
    ready, why = readiness.state(worker.draining)
    return json_response({"activated": True, "ready": ready, "reason": why})


async def park(request: web.Request) -> web.Response:
    """`--park`: this spare node, activated, goes back to the pool. It drains as on SIGTERM
    (refuses new requests, migrates the router's streams, lets the others finish, P's pinned
    pages pulled or released) and is parked until the next `POST /activate`, its prefix cache
    dropped and its instance new, as a node started again would be. Its caller removes it from
    its router first (pd-planner's connector does). 504 where the drain outlasts
    `--drain-timeout-s` (it then stays draining)."""
    worker = request.app[WORKER]
    _check_auth(worker, request)
    readiness = request.app[READINESS]
    if readiness.parked:
        return json_response(
            {"parked": True, "migrated": 0, "integrity": worker.engine.check_integrity()}
        )
    if worker.draining:
        raise APIError(409, "the worker is draining already", code="draining")
    # A caller that leaves mid-drain does not leave the worker draining for good
    body = await asyncio.shield(_park(worker, readiness))
    if body is None:
        raise APIError(
            504,
            f"requests still in flight after {worker.config.drain_timeout_s:g} s of drain",
            "timeout_error",
            code="drain_timeout",
        )
    return json_response(body)


async def _park(worker: Worker, readiness: Readiness) -> dict[str, Any] | None:
    """`park`'s drain, then parked: its answer (None: the drain timed out; still draining)."""
    migrated = worker.begin_drain()
    if not await worker.drained(worker.config.drain_timeout_s):
        return None
    worker.engine.reset_prefix_cache()
    integrity = worker.engine.check_integrity()  # every page back in the pool: "ok"
    worker.instance_id = uuid.uuid4().hex[:16]
    readiness.park()
    worker.draining = False
    log.info("parked after its drain: %d streams migrated, integrity %s", migrated, integrity)
    return {"parked": True, "migrated": migrated, "integrity": integrity}


async def _transfer_ctx(app: web.Application) -> AsyncIterator[None]:
    """The transfer manager of a role that moves KV runs while the app does."""
    transfer = app[WORKER].transfer
    assert transfer is not None
    await transfer.start()
    yield
    await transfer.stop()


def _check_auth(worker: Worker, request: web.Request) -> None:
    key = worker.config.api_key
    if key is None:
        return
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(header_bytes(given), f"Bearer {key}".encode()):
        raise APIError(
            401,
            "invalid or missing API key: send 'Authorization: Bearer <key>'",
            "authentication_error",
            "invalid_api_key",
        )


# ------------------------------------------------------------------------------- endpoints


async def health(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    load = worker.engine.load().to_dict()
    ready, why = request.app[READINESS].state(worker.draining)
    body = {
        "status": "draining" if worker.draining else "ok",
        "ready": ready,  # /ready's answer (readiness.py): the router sends new requests only then
        "not_ready_reason": why,
        "role": worker.role.name,
        "model": worker.model_name,
        "instance": worker.instance_id,
        "pid": os.getpid(),
        "attention_backend": worker.attention_backend,
        "quantization": worker.quantization,
        # compute dtype, linear layers', LM head's, attention: the router pairs equal ones
        "runtime_format": worker.runtime_format,
        "kernels": worker.kernels,
        "compiled_decode": worker.config.compile,
        # the one-row step's background compile (one_row.py): compiling, on, slower, failed
        "one_row_compile": (
            worker.one_row_compile() if worker.one_row_compile else {"state": "off"}
        ),
        "cuda_graph_max_batch": worker.config.cuda_graph_max_batch,
        "load": load,
        **load,
        # "ok", or what is wrong with the pages: from counters and the last full walk (cheap);
        # GET /integrity walks every page.
        "integrity": worker.engine.integrity(),
    }
    if worker.simulation is not None:  # --simulate: says so, with the simulated clock's figures
        body["simulate"] = worker.simulation()
    return json_response(body)  # liveness: 200 while the loop answers, draining included


async def integrity(request: web.Request) -> web.Response:
    """Walk every page's accounting (its time grows with the pool, EXPERIMENTS §23: behind the
    API key, unlike /health)."""
    worker = request.app[WORKER]
    _check_auth(worker, request)
    return json_response({"integrity": worker.engine.check_integrity()})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Drop every cached page no request holds; pages requests still hold stay matchable and
    are counted in the answer."""
    worker = request.app[WORKER]
    _check_auth(worker, request)
    dropped, kept = worker.engine.reset_prefix_cache()
    return json_response({"dropped_pages": dropped, "kept_referenced_pages": kept})


RoleRoute = Callable[[dict[str, Any]], dict[str, Any]]  # a role's JSON route (Role.routes)


def _role_route(serve: RoleRoute) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A route of the worker's role (`Role.routes`): a JSON body in, a JSON answer out, behind
    the API key."""

    async def route(request: web.Request) -> web.Response:
        worker = request.app[WORKER]
        _check_auth(worker, request)
        return json_response(serve(parse_json_body(await request.read())))

    return route


async def tokenizer_endpoint(request: web.Request) -> web.StreamResponse:
    """vLLM's /tokenize (the ids of a prompt or a conversation) and /detokenize (the text of
    token ids): pd/worker/api/tokenize.py."""
    worker = request.app[WORKER]
    _check_auth(worker, request)
    body = parse_json_body(await request.read())
    check_model(body.get("model"), worker.accepted_names, worker.model_name)
    ignore, prompts = worker.config.ignore_unknown_fields, request.app[PROMPTS]
    if request.path == "/tokenize":
        data = await tokenize(prompts, body, worker.engine.max_model_len, ignore)
        return await send_json(request, data)
    return json_response(await detokenize(prompts, body, ignore))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[WORKER].metrics.render(), content_type="text/plain", charset="utf-8"
    )


async def models(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    _check_auth(worker, request)
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": worker.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pd",
                    "max_model_len": worker.engine.max_model_len,
                }
            ],
        }
    )


async def generate(request: web.Request) -> web.StreamResponse:
    worker = request.app[WORKER]
    if worker.tracing.enabled:  # its spans, once it ends (spans.py)
        return await _traced(request, worker)
    return await _generate(request, worker, [])


async def _traced(request: web.Request, worker: Worker) -> web.StreamResponse:
    t_arrive = time.monotonic()
    queued: list[tuple[RequestHandle, float]] = []
    error: str | None = None
    try:
        return await _generate(request, worker, queued)
    except APIError as e:
        error = f"{e.status}: {e.message}"
        raise
    except asyncio.CancelledError:
        error = "the client left"
        raise
    except Exception as e:
        error = repr(e)
        raise
    finally:
        tracing = worker.tracing
        parent = tracing.parent_from_headers(request.headers)
        record_request(
            tracing, parent, worker.role.name, request.path, queued, t_arrive,
            time.monotonic(), error,
        )  # fmt: skip


async def _generate(
    request: web.Request, worker: Worker, queued: list[tuple[RequestHandle, float]]
) -> web.StreamResponse:
    """Answer one OpenAI request; each handle queued goes in `queued` with when it was."""
    _check_auth(worker, request)
    if worker.draining:
        raise APIError(
            503,
            "the worker is shutting down",
            "server_busy",
            "draining",
            headers={"Retry-After": "1"},
        )
    prompts = request.app[PROMPTS]
    # The role's part of a gateway's exchange first (decode: the prefill worker it names)
    raw = await worker.role.body_for(request.path, request.headers, await request.read())
    req = await prompts.parse(request.path, raw)
    if req.model is not None and req.model not in worker.accepted_names:
        raise APIError(
            404,
            f"model '{req.model}' does not exist; this worker serves '{worker.model_name}'",
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    _check_signed(worker, request.remote, req)
    if isinstance(req, ChatCompletionRequest):  # its output parsed into tool calls, if asked
        req.options = request.app[TOOLS].options(req.options, req.tools)
    if req.continuation is not None:
        req = _continuation(worker, req)
    reqs = (
        [req]
        if not isinstance(req, CompletionRequest) or req.batch is None
        else [dataclasses.replace(req, prompt=p, batch=None) for p in req.batch]
    )
    if len(reqs) > 1 and req.kv_transfer_params is not None:
        raise APIError(400, "kv_transfer_params take one prompt", param="kv_transfer_params")
    handles: list[RequestHandle] = []
    handles_out = False  # the answer went to aiohttp to write
    try:
        for r in reqs:
            rules = await _rules(request.app[GRAMMARS], worker, req.options)
            # Each choice its own rules (a grammar's state is the choice's).
            choice_rules = None
            if rules is not None and req.n > 1:
                choice_rules = [
                    await _rules(request.app[GRAMMARS], worker, req.options)
                    for _ in range(req.n - 1)
                ]
            # The role (co-located, prefill or decode: build.py) queues it, tokenizing when
            # it must.
            handles.append(await worker.role.admit(r, _prompt_ids(prompts, r), rules, choice_rules))
            queued.append((handles[-1], time.monotonic()))
        answered = await _answer(request, worker, req, handles)
        handles_out = True
        return answered
    finally:
        for h in handles:  # (each with its other choices)
            worker.engine.abort(h)  # no-op when finished; frees pages when the client left
            worker.metrics.requests.labels(h.seq.finish_reason or "abort").inc()
            if not handles_out:  # cancelled (the router left) after P pinned: release now
                worker.role.unanswered(h, "the router left before P answered")


def _check_signed(worker: Worker, remote: str | None, req: Request) -> None:
    """pd's internal fields come signed, or from loopback (pd/signing.py); a 403 otherwise
    (counted in pd_internal_field_refusals_total)."""
    try:
        if req.continuation is not None:
            sig = req.raw[CONTINUATION].get(SIG)
            worker.guard.check(CONTINUATION, remote, continuation_payload(req.raw), sig)
        kvp = req.kv_transfer_params
        if kvp is not None and worker.role.takes_params:
            worker.guard.check(KV_PARAMS, remote, unsigned(kvp), kvp.get(SIG))
    except APIError as e:
        worker.metrics.internal_refusals.labels(e.param).inc()
        raise


def _continuation(worker: Worker, req: Request) -> Request:
    """A continuation (docs/migration.md §3): one prompt, ids this model has; its prompt's part
    (echo, prompt_logprobs) went out with the first worker's answer, so none is answered here."""
    assert req.continuation is not None
    if isinstance(req, CompletionRequest) and req.batch is not None:
        raise bad_request("'pd_continuation' continues one prompt's choice", "pd_continuation")
    vocab = worker.vocab_size or worker.tokenizer.vocab_size
    if req.continuation and max(req.continuation) >= vocab:
        raise bad_request(
            f"'pd_continuation' names a token id past the vocabulary ({vocab})", "pd_continuation"
        )
    req.options = dataclasses.replace(req.options, prompt_logprobs=None)
    req.prompt_logprobs = None
    if isinstance(req, CompletionRequest):
        req.echo = False
    return req


async def _answer(
    request: web.Request, worker: Worker, req: Request, handles: list[RequestHandle]
) -> web.StreamResponse:
    chat = isinstance(req, ChatCompletionRequest)
    tools = req.tools if isinstance(req, ChatCompletionRequest) else None
    builders, per_prompt = [], []
    token_text = request.app[TOKEN_TEXT]
    # The router's streams: each event with new tokens says their ids (docs/migration.md §1).
    announce_ids = req.stream and request.headers.get(TOKEN_IDS_HEADER) == "1"
    # Before a choice's first delta: its prompt part (echo, prompt_logprobs), from its prompt's
    # first handle (the one that prefilled it).
    readies: dict[int, Callable[[], Awaitable[None]]] = {}
    for j, handle in enumerate(handles):
        prompt_tokens = len(handle.seq.prompt_ids)
        worker.metrics.prompt_tokens.inc(prompt_tokens)
        part = _prompt_part(worker, req, handle, token_text)
        for i, _ in enumerate((handle, *handle.forks)):
            builder = ResponseBuilder(
                chat=chat,
                model=worker.model_name,
                prompt_tokens=prompt_tokens,
                token_text=token_text,
                wants_logprobs=req.options.wants_logprobs,
                cached_tokens=_cached_tokens(handle),
                prompt_part=part,
                index=j * req.n + i,
                # Each choice parses its own text for tool calls, if the request has tools.
                tools=request.app[TOOLS].stream(tools) if chat else None,
                announce_ids=announce_ids,
                streaming=req.stream,
            )
            if builder.tools is not None and handle.given_text:
                builder.tools.feed(handle.given_text)  # a continuation's: its deltas went out
            builders.append(builder)
            readies[id(builder)] = functools.partial(
                _prompt_ready, request.app[PROMPTS], builder, handle
            )
            if i == 0:
                per_prompt.append(builder)
    for b in builders[1:]:  # one answer: one id and time
        b.id, b.created = builders[0].id, builders[0].created
    choices = choices_of(handles)
    if req.stream:
        return await _stream(
            request, choices, builders, per_prompt, readies, req.include_usage, announce_ids
        )
    await collect(choices, builders, lambda b: readies[id(b)]())

    def answer() -> bytes:
        body = builders[0].final({KV_PARAMS: handles[0].kv_transfer_params})
        if len(builders) > 1:
            body["choices"] = [b.choice() for b in builders]
            body["usage"] = usage(per_prompt, builders)
        return orjson.dumps(body)

    # Each choice repeats its prompt's part (echo, prompt logprobs): large ones are written as
    # JSON on the text thread.
    entries = sum(_prompt_entries(b) for b in builders)
    data = await request.app[PROMPTS].off_loop(entries >= LARGE_PROMPT_PART, answer)
    if _gone(request):  # P's answer can reach no one: `generate` releases its pins now
        raise ConnectionResetError("the client left before the answer")
    return await send_json(request, data)


def _gone(request: web.Request) -> bool:
    """The client closed its connection (on P: the router left, its client did)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _prompt_entries(b: ResponseBuilder) -> int:
    part = b.prompt
    return 0 if part is None else len(part.entries) + len(part.prompt_logprobs or ())


def _cached_tokens(handle: RequestHandle) -> Callable[[], int]:
    return lambda: handle.seq.num_cached_tokens or 0


def _prompt_ids(prompts: PromptBuilder, req: Request) -> Callable[[], Awaitable[list[int]]]:
    return lambda: prompts.prompt_ids(req)


def _prompt_part(
    worker: Worker,
    req: CompletionRequest | ChatCompletionRequest,
    handle: RequestHandle,
    token_text: Callable[[int], str],
) -> Callable[[], PromptPart] | None:
    """What builds the answer's prompt part (echo, prompt_logprobs), when the request asks."""
    echo = isinstance(req, CompletionRequest) and req.echo
    if not echo and req.prompt_logprobs is None:
        return None
    seq = handle.seq
    return once(  # built once for the prompt's n choices
        lambda: prompt_part(
            seq.prompt_ids,
            seq.prompt_logprobs,
            worker.tokenizer,
            token_text,
            echo=echo,
            echo_logprobs=req.options.top_logprobs if echo and req.options.logprobs else None,
            prompt_logprobs=req.prompt_logprobs,
        )
    )


async def _prompt_ready(
    prompts: PromptBuilder, builder: ResponseBuilder, handle: RequestHandle
) -> None:
    """Before the first delta: build the answer's prompt part, on the text thread when large
    (none when P hands the request to D: D answers it, from the params)."""
    if builder.prompt_part is None or builder.prompt is not None or builder.started:
        return
    if handle.kv_transfer_params is not None:
        builder.prompt = PromptPart()
        return
    entries = builder.prompt_tokens * (1 + (handle.seq.params.prompt_logprobs or 0))
    builder.prompt = await prompts.off_loop(entries >= LARGE_PROMPT_PART, builder.prompt_part)


async def _keep_alive(resp: web.StreamResponse, written: list[float]) -> None:
    """A comment on a stream silent for KEEPALIVE_S (waiting, prefilling, waiting for pages):
    at least one every 10 s, so the router's idle watch and proxies see it alive."""
    try:
        while True:
            await asyncio.sleep(max(0.05, written[0] + KEEPALIVE_S - time.monotonic()))
            if time.monotonic() - written[0] >= KEEPALIVE_S:
                written[0] = time.monotonic()
                await resp.write(SSE_KEEPALIVE)
    except (ConnectionResetError, RuntimeError):  # the client left, or the stream ended
        return


async def _rules(
    grammars: GrammarCompiler, worker: Worker, options: GenerationOptions
) -> TokenRules | None:
    """The request's token rules (its grammar compiled off the loop); a 400 for a constraint
    that does not compile in time or token ids this model does not have."""
    vocab = grammars.vocab_size
    for name, ids in (
        ("logit_bias", [t for t, _ in options.logit_bias]),
        ("allowed_token_ids", options.allowed_token_ids or ()),
    ):
        if ids and max(ids) >= vocab:
            raise APIError(
                400, f"'{name}' names a token id past the vocabulary ({vocab})", param=name
            )
    try:
        return await rules_for(options, worker.tokenizer, grammars)
    except GrammarError as e:
        raise APIError(
            400, f"invalid structured-output constraint: {e}", code="invalid_grammar"
        ) from None
    except GrammarUnavailable as e:
        raise APIError(
            503,
            f"structured outputs: {e}",
            "service_unavailable",
            "grammar_unavailable",
            headers={"Retry-After": "1"},
        ) from None


async def _stream(
    request: web.Request,
    choices: list[RequestHandle],
    builders: list[ResponseBuilder],
    per_prompt: list[ResponseBuilder],
    readies: dict[int, Callable[[], Awaitable[None]]],
    include_usage: bool,
    migratable: bool = False,
) -> web.StreamResponse:
    """The SSE answer. `migratable` (the router's, with X-PD-Token-Ids): a drain ends it with
    `: pd-migrate draining` and no [DONE] (docs/migration.md §2; `Worker.migrate_streams`)."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    worker = request.app[WORKER]
    if migratable:
        worker.migratable.add(tuple(choices))
        if worker.draining:  # it came in as the drain began
            worker.migrate_streams()
    written = [time.monotonic()]  # when the stream last carried an event (keep-alive's clock)

    async def emit(data: bytes) -> None:
        written[0] = time.monotonic()
        await resp.write(data)

    keepalive = asyncio.create_task(_keep_alive(resp, written))
    try:
        if builders[0].chat:
            for b in builders:
                await emit(b.chunk(None, role=True))
        async for builder, delta in interleave(choices, builders):
            if delta.migrate:
                await emit(SSE_MIGRATE)
                await resp.write_eof()
                return resp
            if delta.error is not None:  # headers are out: the error is the stream's last event
                await emit(sse(delta.error.body()))
                break
            await readies[id(builder)]()
            builder.add(delta)
            await emit(builder.chunk(delta))
    finally:
        keepalive.cancel()
        worker.migratable.discard(tuple(choices))
    if include_usage:
        await emit(builders[0].usage_chunk(usage(per_prompt, builders)))
    await emit(SSE_DONE)
    await resp.write_eof()
    return resp
