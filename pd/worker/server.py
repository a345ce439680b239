"""The worker's HTTP face: OpenAI endpoints, /v1/models, /health, /metrics (aiohttp, orjson)."""

from __future__ import annotations

import asyncio
import hmac
import logging

import orjson
from aiohttp import web

from pd.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    error_body,
    parse_json_body,
    parse_request,
)
from pd.worker.decode_side import DecodeSide
from pd.worker.engine import RequestHandle
from pd.worker.kv_transfer import KVContract, start_transfer
from pd.worker.openai_format import SSE_DONE, ResponseBuilder, sse
from pd.worker.prefill_side import PrefillSide
from pd.worker.sampling_params import SamplingParams
from pd.worker.worker import Worker

log = logging.getLogger(__name__)

WORKER = web.AppKey("worker", Worker)
MAX_BODY_BYTES = 32 * 1024 * 1024


def json_response(body: object, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return json_response(e.body(), e.status, e.headers)
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
    app = web.Application(middlewares=[errors_middleware], client_max_size=MAX_BODY_BYTES)
    app[WORKER] = worker
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.cleanup_ctx.append(_engine_ctx)
    if worker.config.role != "both":
        app.cleanup_ctx.append(_transfer_ctx)
    return app


async def _engine_ctx(app: web.Application):
    engine = app[WORKER].engine
    engine.start()
    yield
    await engine.stop()


async def _transfer_ctx(app: web.Application):
    """Prefill and decode roles: the KV transfer manager and the side that uses it."""
    worker = app[WORKER]
    engine = worker.engine
    manager = await start_transfer(worker.config, engine.runner)
    contract = KVContract.of(engine.runner)
    if worker.config.role == "prefill":
        worker.prefill_side = PrefillSide(manager, engine.scheduler, contract, worker.config.tp)
        engine.hand_off = worker.prefill_side.hand_off
    else:
        worker.decode_side = DecodeSide(manager, engine, contract)
    worker.bootstrap_port = manager.bootstrap_port
    yield
    if worker.decode_side is not None:
        await worker.decode_side.stop()
    await manager.close()  # aborts what is left: pinned and reserved pages are released
    worker.prefill_side = worker.decode_side = None
    engine.hand_off = None


def _check_auth(worker: Worker, request: web.Request) -> None:
    key = worker.config.api_key
    if key is None:
        return
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise APIError(
            401,
            "invalid or missing API key: send 'Authorization: Bearer <key>'",
            "authentication_error",
            "invalid_api_key",
        )


# ------------------------------------------------------------------------------- endpoints


async def health(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    load = worker.engine.load()
    body = {
        "status": "draining" if worker.draining else "ok",
        "role": worker.config.role,
        "model": worker.model_name,
        "load": load.to_dict(),
        **load.to_dict(),
    }
    return json_response(body, 503 if worker.draining else 200)


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
    _check_auth(worker, request)
    if worker.draining:
        raise APIError(
            503,
            "the worker is shutting down",
            "server_busy",
            "draining",
            headers={"Retry-After": "1"},
        )
    req = parse_request(request.path, parse_json_body(await request.read()))
    if req.model is not None and req.model not in worker.accepted_names:
        raise APIError(
            404,
            f"model '{req.model}' does not exist; this worker serves '{worker.model_name}'",
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    if worker.decode_side is not None:
        kvp = worker.decode_side.validate(req.kv_transfer_params)
        prompt_ids = kvp.prompt_token_ids  # D never re-tokenizes
        params = _sampling_params(worker, req, len(prompt_ids))
        handle = await worker.decode_side.start(kvp, params)
    else:
        remote_decode = _wants_remote_decode(worker, req)
        prompt_ids = _prompt_ids(worker, req)
        params = _sampling_params(worker, req, len(prompt_ids))
        handle = worker.engine.add_request(prompt_ids, params, remote_decode)
    worker.metrics.prompt_tokens.inc(len(prompt_ids))
    builder = ResponseBuilder(
        chat=isinstance(req, ChatCompletionRequest),
        model=worker.model_name,
        prompt_tokens=len(prompt_ids),
        token_text=lambda t: worker.tokenizer.decode([t], False),
        wants_logprobs=params.wants_logprobs,
    )
    try:
        if req.stream:
            return await _stream(request, handle, builder, req.include_usage)
        while builder.finish_reason is None:
            delta = await handle.queue.get()
            if delta.error is not None:
                raise delta.error
            builder.add(delta)
        return json_response(builder.final({"kv_transfer_params": handle.kv_transfer_params}))
    finally:
        worker.engine.abort(handle)  # no-op when finished; frees pages when the client left
        worker.metrics.requests.labels(handle.seq.finish_reason or "abort").inc()


def _wants_remote_decode(worker: Worker, req) -> bool:
    """Prefill role: `kv_transfer_params={"do_remote_decode": true}` (set by the router) asks to
    keep the KV for a decode worker; without it a prefill worker answers like any other."""
    kvp = req.kv_transfer_params
    if kvp is None:
        return False
    if worker.prefill_side is None or kvp.get("do_remote_decode") is not True:
        raise bad_request(
            f"this {worker.config.role} worker does not take kv_transfer_params {kvp}",
            param="kv_transfer_params",
        )
    if req.stream:
        raise bad_request("a remote-decode prefill answers with stream=false", param="stream")
    return True


async def _stream(
    request: web.Request, handle: RequestHandle, builder: ResponseBuilder, include_usage: bool
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    if builder.chat:
        await resp.write(builder.chunk(None, role=True))
    while builder.finish_reason is None:
        delta = await handle.queue.get()
        if delta.error is not None:  # headers are out: the error is the stream's last event
            await resp.write(sse(delta.error.body()))
            break
        builder.add(delta)
        await resp.write(builder.chunk(delta))
    if include_usage:
        await resp.write(builder.usage_chunk())
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp


# ------------------------------------------------------------------------------- helpers


def _prompt_ids(worker: Worker, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
    tok = worker.tokenizer
    if isinstance(req, ChatCompletionRequest):
        try:
            text = tok.apply_chat_template(req.messages, add_generation_prompt=True)
        except Exception as e:  # a template's raise_exception, or a malformed conversation
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        return tok.encode(text)
    if isinstance(req.prompt, str):
        return tok.encode(req.prompt)
    bad = [t for t in req.prompt if t >= tok.vocab_size]
    if bad:
        raise bad_request(
            f"token id {bad[0]} is out of the vocabulary (size {tok.vocab_size})", param="prompt"
        )
    return list(req.prompt)


def _sampling_params(worker: Worker, req, prompt_len: int) -> SamplingParams:
    o = req.options
    room = worker.engine.max_model_len - prompt_len
    max_tokens = o.max_tokens
    if room <= 0:
        worker.engine.check_fits(prompt_len, 1)  # raises the context-length error
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(
            400,
            f"this model's context length is {worker.engine.max_model_len} tokens, but "
            f"{prompt_len + max_tokens} were asked for ({prompt_len} in the prompt, {max_tokens} "
            "in the completion): lower max_tokens or shorten the prompt",
            code="context_length_exceeded",
            param="max_tokens",
        )
    try:
        return SamplingParams(**{**vars(o), "max_tokens": max_tokens})
    except ValueError as e:
        raise bad_request(str(e)) from None
