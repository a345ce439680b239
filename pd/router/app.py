"""`make_app(cfg)`: the router's aiohttp application (OpenAI endpoints, health, metrics, admin)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
from collections.abc import AsyncIterator
from time import perf_counter

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST

import pd.router.admin as admin
import pd.router.fanout as fanout
import pd.router.tokenize as tokenize
from pd.cors import enable_cors
from pd.kube_api import KubeAPI
from pd.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    error_body,
    header_bytes,
    parse_json_body,
    parse_request,
    require_json,
    unknown_fields,
)
from pd.protocol.names import REQUEST_ID_HEADER
from pd.router.admission import CLASS_HEADER, PRIORITY_OF_CLASS, Admission
from pd.router.answer_size import check_expected
from pd.router.config import RouterConfig
from pd.router.discovery import FileDiscovery
from pd.router.discovery.kubernetes import KubernetesDiscovery
from pd.router.exchange import Exchange, RequestFacts
from pd.router.health import HealthChecker
from pd.router.keys import ADMISSION, CONFIG, HEALTH, METRICS, PICKER, PROXY, REGISTRY
from pd.router.metrics import RouterMetrics
from pd.router.migrate import CONTINUATION
from pd.router.picker import Picker, picker_health, serve_picker
from pd.router.prefix_index import PromptKey, prompt_bytes
from pd.router.proxy import KV, Proxy, json_response
from pd.router.registry import Registry
from pd.signing import optional_token
from pd.tracing import NO_SPAN, Span, setup_tracing

log = logging.getLogger("pd.router")
TICKET = "pd_ticket"  # the request's admission ticket (request[TICKET])
SPAN = "pd_span"  # the request's span, when traced (request[SPAN])


def _error(
    status: int,
    message: str,
    type: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return json_response(error_body(message, type, code), status, headers)


_AUTHED = ("/v1/", "/tokenize", "/detokenize")  # what --api-key guards


def _middleware(cfg: RouterConfig) -> Middleware:
    expected = f"Bearer {cfg.api_key}".encode() if cfg.api_key else None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Client auth on /v1/*, and every error as an OpenAI-style JSON body (one place)."""
        try:
            if (
                expected is not None
                and request.path.startswith(_AUTHED)
                and request.method != "OPTIONS"  # a CORS preflight carries no credentials
            ):
                given = header_bytes(request.headers.get("Authorization", ""))
                if not hmac.compare_digest(given, expected):
                    raise APIError(
                        401,
                        "invalid or missing API key (send 'Authorization: Bearer KEY')",
                        "invalid_request_error",
                        "invalid_api_key",
                    )
            require_json(request.method, request.body_exists, request.content_type)
            return await handler(request)
        except APIError as e:
            return json_response(e.body(), e.status, e.headers or None)
        except web.HTTPRequestEntityTooLarge:
            return _error(
                413,
                f"request body is larger than {cfg.max_body_bytes} bytes",
                "invalid_request_error",
                "request_too_large",
            )
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(
                e.status,
                e.reason,
                "invalid_request_error",
                "not_found" if e.status == 404 else None,
            )
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # every failure is answered as OpenAI-style JSON
            log.exception("unhandled error on %s", request.path)
            return _error(500, f"internal error: {type(e).__name__}", "internal_error", None)

    return middleware


def _check_prompt_size(
    cfg: RouterConfig, data: bytes, req: CompletionRequest | ChatCompletionRequest
) -> None:
    """A prompt over --max-prompt-bytes (in its canonical bytes) is a 400, before routing."""
    if len(data) > cfg.max_prompt_bytes:
        raise bad_request(
            f"the prompt is {len(data)} bytes, over this router's limit of "
            f"{cfg.max_prompt_bytes} bytes (--max-prompt-bytes)",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="prompt_too_large",
        )


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions and /v1/chat/completions."""
    t0 = perf_counter()
    proxy = request.app[PROXY]
    proxy.metrics.arrivals += 1
    route, status, ex = "none", "500", None
    try:
        raw = await request.read()
        body = parse_json_body(raw)
        cfg = proxy.cfg
        req = parse_request(request.path, body, ignore_unknown_fields=cfg.ignore_unknown_fields)
        body.pop(KV, None)  # only the router sets them (cache_salt stays: workers need it too)
        body.pop(CONTINUATION, None)  # (as kv_transfer_params: set by the router only)
        chat = isinstance(req, ChatCompletionRequest)
        if cfg.ignore_unknown_fields:  # what the workers would refuse: they never see it
            for name in unknown_fields(body, chat):
                del body[name]
        headers = proxy.headers
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request_id:
            headers = {**headers, REQUEST_ID_HEADER: request_id}
        key = request.headers.get("X-Room-Id") or req.room_key

        prompts = len(req.batch) if isinstance(req, CompletionRequest) and req.batch else 1
        answer_limit = cfg.max_answer_bytes // prompts  # each prompt's share

        def exchange(sub: CompletionRequest | ChatCompletionRequest, body: dict) -> Exchange:
            data = prompt_bytes(sub)
            _check_prompt_size(proxy.cfg, data, sub)
            tokens = proxy.registry.estimate.tokens(len(data)) + 1
            check_expected(sub, 1, tokens, answer_limit)
            facts = RequestFacts(
                path=request.path,
                body=body,
                chat=chat,
                stream=req.stream,
                include_usage=req.include_usage,
                max_tokens=req.options.max_tokens,
                n=req.n,
                seed=req.options.seed,
                prompt_logprobs=req.options.prompt_logprobs is not None,
                key=key,
                prompt=PromptKey.of(data, sub.cache_salt, hashed=cfg.prefix_index_blocks > 0),
                tokens=tokens,
                headers=headers,
            )
            return Exchange(
                request, facts, t0, answer_limit=answer_limit, span=request.get(SPAN, NO_SPAN)
            )

        admission = request.app[ADMISSION]
        cls = admission.class_of(request.headers.get(CLASS_HEADER), req.priority)
        if not admission.enabled:  # first come, first served here and on the workers
            if req.priority:
                raise bad_request(
                    f"priority {req.priority} asks for priority scheduling, which this router "
                    "does not do (--no-priority)",
                    param="priority",
                )
        elif req.priority is None and cls != "default":  # the workers order by it
            body["priority"] = PRIORITY_OF_CLASS[cls]
        tracing = proxy.tracing
        if tracing.enabled:
            span = tracing.start(
                f"POST {request.path}",
                tracing.parent_from_headers(request.headers),
                kind="server",
                attributes={"pd.class": cls, "pd.stream": req.stream, "pd.n": req.n},
            )
            request[SPAN] = span

        if isinstance(req, CompletionRequest) and req.batch is not None:
            # A list of prompts: one sub-exchange each, routed by its own prompt (fanout.py).
            subs = [
                exchange(
                    dataclasses.replace(req, prompt=p, batch=None),
                    _sub_body(body, p, req.stream),
                )
                for p in req.batch
            ]
            ex = subs[0]
            route = proxy.registry.route()
            work = fanout.serve(proxy, request, subs, route, req.n, req.include_usage, req.stream)
        else:
            ex = exchange(req, body)
            route = proxy.registry.route()
            work = proxy.handle(ex, route)
        try:
            t_enter = perf_counter()
            ticket = await admission.enter(cls)
        except BaseException:
            work.close()  # never started
            raise
        request[TICKET] = ticket
        if ex.span.recording:
            ex.span.set("pd.admission_wait_s", perf_counter() - t_enter)
        try:
            resp = await ticket.run(work)
        finally:
            admission.leave(ticket)
        status = ex.status or str(resp.status)
        return resp
    except (APIError, web.HTTPException) as e:
        status = str(e.status)
        raise
    except asyncio.CancelledError:
        status = "499"  # the client went away
        raise
    finally:
        if ex is not None and ex.route is not None:
            route = ex.route
        proxy.metrics.request_done(status, route, ex.ttft if ex else None, perf_counter() - t0)
        traced = request.get(SPAN)
        if traced is not None:
            _end_request_span(traced, status, route, ex)


def _end_request_span(span: Span, status: str, route: str, ex: Exchange | None) -> None:
    span.set("pd.route", route)
    if status.isdigit():
        span.set("http.response.status_code", int(status))
    if ex is not None and ex.ttft is not None:
        span.set("pd.ttft_s", ex.ttft)
    if status == "499":
        span.event("the client went away")
    elif not status.isdigit() or int(status) >= 500:
        span.error(f"answered {status}")
    span.end()


def _sub_body(body: dict, prompt: str | list[int], stream: bool) -> dict:
    """One prompt's body of a list of prompts; a stream's reports its usage (summed)."""
    sub = {**body, "prompt": prompt}
    if stream:
        sub["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return sub


async def models(request: web.Request) -> web.Response:
    names = sorted({w.model for w in request.app[REGISTRY] if w.healthy and w.model})
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "pd"} for n in names]
    return json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    try:
        mode, status = registry.route(), 200
    except APIError:
        mode, status = None, 503
    body = {
        "status": "ok" if status == 200 else "unavailable",
        "mode": mode,
        "pools": registry.snapshot(),
    }
    return json_response(body, status)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    """One client session for every worker call; the first health round; the check loop."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30.0)
    session = aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),  # workers set no cookies: skip the jar per request
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        auto_decompress=False,  # bytes are relayed as they come; workers do not compress
    )
    app[PROXY].session = session
    checker = app[HEALTH]
    checker.session = session
    tasks = []
    cfg = app[CONFIG]
    if cfg.discovery_file is not None:
        discovery = FileDiscovery(cfg.discovery_file, app[REGISTRY], cfg.discovery_interval_s)
        discovery.sync()  # the workers listed at start are checked with the others
        tasks.append(asyncio.create_task(discovery.run()))
    if cfg.discovery == "kubernetes":
        api = KubeAPI.from_flags(cfg.k8s_api, cfg.k8s_namespace)
        kube = KubernetesDiscovery(api, cfg.k8s_selectors, app[REGISTRY], cfg.k8s_port_name)
        tasks.append(asyncio.create_task(kube.run()))
    await checker.check_all()
    tasks += [asyncio.create_task(checker.run()), asyncio.create_task(app[PROXY].idle.run())]
    grpc_server = None
    if cfg.endpoint_picker:
        picker = app[PICKER] = Picker(
            app[REGISTRY],
            hashed=cfg.prefix_index_blocks > 0,
            token=optional_token(cfg.cluster_token),
            shed=cfg.picker_shed,
        )
        grpc_server, port, checks = await serve_picker(picker, cfg.host, cfg.picker_port)
        picker.port = port
        app[METRICS].picker = picker
        tasks.append(asyncio.create_task(picker_health(picker, checks, cfg.health_interval)))
        log.info("endpoint picker (ext_proc) on %s:%d", cfg.host, port)
    try:
        yield
    finally:
        if grpc_server is not None:
            await grpc_server.stop(1.0)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await session.close()
        await asyncio.to_thread(app[PROXY].tracing.shutdown)  # the last spans out (<= 5 s)


async def _first_byte(request: web.Request, response: web.StreamResponse) -> None:
    """A response's headers go out: its request is past preemption (admission.py)."""
    ticket = request.get(TICKET)
    if ticket is not None:
        ticket.sent = True


def make_app(cfg: RouterConfig) -> web.Application:
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[_middleware(cfg)])
    registry = Registry(cfg)
    router_metrics = RouterMetrics(registry)
    router_metrics.admission = app[ADMISSION] = Admission(
        cfg.max_concurrency, cfg.class_limits, enabled=not cfg.no_priority
    )
    app.on_response_prepare.append(_first_byte)
    worker_headers = (
        {"Authorization": f"Bearer {cfg.worker_api_key}"} if cfg.worker_api_key else None
    )
    checker = HealthChecker(cfg, registry, router_metrics, worker_headers)
    app[CONFIG] = cfg
    app[REGISTRY] = registry
    app[METRICS] = router_metrics
    app[HEALTH] = checker
    tracing = setup_tracing("pd-router", "router", cfg.otlp_endpoint, cfg.otlp_sample_ratio)
    app[PROXY] = Proxy(cfg, registry, router_metrics, checker, tracing)
    app.cleanup_ctx.append(_upstream_ctx)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize.forward)
    app.router.add_post("/detokenize", tokenize.forward)
    admin.add_routes(app)
    enable_cors(app, cfg.allowed_origins)
    return app
