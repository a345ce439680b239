"""`pd-router --endpoint-picker`: pd as the endpoint picker of the Gateway API Inference Extension
(GIE). An Envoy-based gateway consults it over `ext_proc` (gRPC) for each request; it reads the
request's headers and body, picks the decode worker with pd's own policies (the decode pool's:
load-aware, cache-aware on the prompt, sticky), and answers with the pick:

- the `x-gateway-destination-endpoint` header (`ip:port`) and the same key in the `envoy.lb`
  dynamic metadata, which Envoy's original-destination cluster sends the request to;
- the prefill worker it picked too, as llm-d does: `x-prefiller-host-port`, signed with the
  cluster token for this body (`x-pd-prefiller-sig`): a decode worker that has that prefill
  worker among its `--prefill-peer`s runs the P -> D exchange itself
  (pd/worker/disagg/prefiller.py), so a gateway that forwards to one endpoint still gets
  disaggregation;
- a subset hint from the gateway (`envoy.lb.subset_hint`, `x-gateway-destination-endpoint-subset`)
  limits the pick to those endpoints;
- no decode worker to take it: an immediate 503 (OpenAI-style JSON, `Retry-After`); while every
  decode worker is busy (alive, but none ready: each has said it cannot admit), with
  `--picker-shed`: 429 (without it, as the router does, the least loaded busy one queues it).

It serves the gRPC health service (overall and `envoy.service.ext_proc.v3.ExternalProcessor`),
SERVING while the router has a healthy decode worker. The workers are the router's (its
registry, its health checks, its discovery); `decisions` counts the picks made.

Needs the `k8s` extra (grpcio, grpcio-health-checking, xds-protos); without it the flag is a
clear error."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pd.protocol import APIError, error_body, parse_json_body, parse_request
from pd.protocol.names import PREFILLER as PREFILLER_FIELD
from pd.protocol.names import PREFILLER_HEADER, PREFILLER_SIG_HEADER, REQUEST_ID_HEADER
from pd.registration import host_port
from pd.router.prefix_index import PromptKey, prompt_bytes
from pd.router.registry import Registry
from pd.router.worker import Worker
from pd.signing import prefiller_payload, sign

log = logging.getLogger("pd.router")

DESTINATION = "x-gateway-destination-endpoint"
PREFILLER = PREFILLER_HEADER
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
MISSING = "the endpoint picker needs the k8s extra: pip install 'pd[k8s]' (grpcio, xds-protos)"


@dataclass
class Pick:
    decode: Worker
    prefill: Worker | None


@dataclass
class Picker:
    """The decision, apart from the gRPC plumbing (the servicer below): which workers take a
    request, from its path, headers and body."""

    registry: Registry
    hashed: bool = True  # the prefix index is on: cache-aware picks hash the prompt
    token: bytes | None = None  # the cluster token: signs the prefill worker named for D
    shed: bool = False  # --picker-shed: 429 while every decode worker is busy (not ready)
    port: int = 0  # the gRPC port it serves on
    decisions: int = 0
    picked: dict[str, int] = field(default_factory=dict)  # ip:port -> picks
    refusals: dict[int, int] = field(default_factory=dict)  # status -> requests refused

    def pick(
        self, path: str, headers: dict[str, str], body: bytes, subset: list[str] | None
    ) -> Pick:
        """The decode worker (and prefill worker) for this request; APIError: 400 for a body
        pd refuses, 503 when no decode worker can take it."""
        key, prompt = None, None
        if path in ("/v1/completions", "/v1/chat/completions"):
            parsed = parse_json_body(body)
            req = parse_request(path, parsed)
            key = headers.get("x-room-id") or req.room_key
            if not (hasattr(req, "batch") and getattr(req, "batch", None)):
                prompt = PromptKey.of(prompt_bytes(req), req.cache_salt, hashed=self.hashed)
        pool = self.registry.decode if self.registry.decode.healthy else self.registry.both
        allowed = set(subset) if subset else None
        exclude = [
            w for w in pool.healthy if allowed is not None and host_port(w.url) not in allowed
        ]
        if self.shed and pool.all_busy:  # every one is alive but admits nothing now
            raise APIError(429, "every decode worker is busy: retry later", "rate_limit_exceeded",
                           "overloaded", headers={"Retry-After": "1"})  # fmt: skip
        decode = pool.choose(key, exclude, prompt)
        if decode is None:
            why = (
                "no decode worker in the gateway's subset"
                if allowed
                else "no healthy decode worker"
            )
            raise APIError(503, why, "service_unavailable", "no_healthy_worker",
                           headers={"Retry-After": "1"})  # fmt: skip
        prefill = None
        if pool is self.registry.decode and self.registry.prefill.healthy:
            prefill = self.registry.prefill.choose(key, (), prompt)
        if prompt is not None and prompt.blocks:
            # The answer never passes here: the prompt's KV is taken to be where it goes now
            # (the decode worker pulls or computes it), for the next cache-aware pick.
            pool.record(decode, prompt.blocks)
            if prefill is not None:
                self.registry.prefill.record(prefill, prompt.blocks)
        self.decisions += 1
        hp = host_port(decode.url)
        self.picked[hp] = self.picked.get(hp, 0) + 1
        return Pick(decode, prefill)


def make_servicer(picker: Picker) -> Any:
    """The ext_proc servicer (grpcio and xds-protos imported here: the optional extra)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg
    from envoy.type.v3 import http_status_pb2
    from google.protobuf import struct_pb2

    def header(key: str, value: str) -> Any:
        return base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=key, raw_value=value.encode())
        )

    def answer(phase: str, pick: Pick, body: bytes) -> Any:
        dest = host_port(pick.decode.url)
        sets = [header(DESTINATION, dest)]
        if pick.prefill is not None:
            named = host_port(pick.prefill.url)
            sets.append(header(PREFILLER, named))
            if picker.token is not None:  # D runs the exchange only when it is signed
                sig = sign(picker.token, PREFILLER_FIELD, prefiller_payload(named, body))
                sets.append(header(PREFILLER_SIG_HEADER, sig))
        common = ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=sets), clear_route_cache=True
        )
        meta = struct_pb2.Struct()
        meta.update({LB_NAMESPACE: {DESTINATION: dest}})
        kind = ep.BodyResponse if phase == "request_body" else ep.HeadersResponse
        return ep.ProcessingResponse(**{phase: kind(response=common)}, dynamic_metadata=meta)

    def refuse(e: APIError) -> Any:
        body = json.dumps(error_body(e.message, e.type, e.code, e.param)).encode()
        hs = [header("content-type", "application/json")]
        hs += [header(k.lower(), v) for k, v in (e.headers or {}).items()]
        return ep.ProcessingResponse(
            immediate_response=ep.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=e.status),
                headers=ep.HeaderMutation(set_headers=hs),
                body=body,
                details=e.code or "refused",
            )
        )

    def subset_of(req: Any) -> list[str] | None:
        md = req.metadata_context.filter_metadata
        if SUBSET_NAMESPACE not in md:
            return None
        value = md[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
        if value is None:
            return None
        if value.HasField("list_value"):
            return [v.string_value for v in value.list_value.values]
        return [s.strip() for s in value.string_value.split(",") if s.strip()]

    class Servicer(epg.ExternalProcessorServicer):
        async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:  # noqa: N802
            path, headers, body, subset = "", {}, b"", None
            async for req in requests:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    headers = {
                        h.key.lower(): (h.raw_value.decode() if h.raw_value else h.value)
                        for h in req.request_headers.headers.headers
                    }
                    path = headers.get(":path", "").split("?", 1)[0]
                    subset = subset_of(req)
                    if not req.request_headers.end_of_stream:
                        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                        continue
                    phase = "request_headers"
                elif kind == "request_body":
                    body += req.request_body.body
                    if not req.request_body.end_of_stream:
                        yield ep.ProcessingResponse(request_body=ep.BodyResponse())
                        continue
                    phase = "request_body"
                else:  # what the filter is not configured to send: let it through
                    yield ep.ProcessingResponse(**{kind: _empty(ep, kind)})
                    continue
                try:
                    got = picker.pick(path, headers, body, subset)
                except APIError as e:
                    picker.refusals[e.status] = picker.refusals.get(e.status, 0) + 1
                    log.info("picker refused %s %s: %d %s", path,
                             headers.get(REQUEST_ID_HEADER.lower(), ""), e.status, e.message)  # fmt: skip
                    yield refuse(e)
                    continue
                yield answer(phase, got, body)

    return Servicer()


def _empty(ep: Any, kind: str) -> Any:
    if kind in ("response_headers",):
        return ep.HeadersResponse()
    if kind in ("response_body",):
        return ep.BodyResponse()
    return ep.TrailersResponse()


async def picker_health(picker: Picker, checks: Any, interval_s: float) -> None:
    """The gRPC health service says SERVING while a decode (or co-located) worker is healthy."""
    from grpc_health.v1 import health_pb2

    status = None
    while True:
        r = picker.registry
        now = (
            health_pb2.HealthCheckResponse.SERVING
            if r.decode.healthy or r.both.healthy
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if now != status:
            for name in ("", SERVICE):
                await checks.set(name, now)
            status = now
        await asyncio.sleep(interval_s)


async def serve_picker(picker: Picker, host: str, port: int) -> tuple[Any, int, Any]:
    """Start the gRPC server (ext_proc and health); (server, port, health servicer)."""
    try:
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    except ImportError as e:
        raise RuntimeError(f"{MISSING} ({e})") from None
    server = grpc.aio.server()
    epg.add_ExternalProcessorServicer_to_server(make_servicer(picker), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ("", SERVICE):  # until picker_health reads the workers
        await checks.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, bound, checks
