"""OTLP over HTTP: ended spans encoded by hand into an `ExportTraceServiceRequest` (protobuf wire
format, field numbers from opentelemetry-proto) and POSTed to a collector's `/v1/traces`."""

from __future__ import annotations

import gzip
import http.client
import logging
import operator
import ssl
import struct
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

from pd.tracing.spans import (
    _KIND_NAMES,
    _LOW64,
    EXPORT_TIMEOUT_S,
    AttributeValue,
    _Recording,
)

log = logging.getLogger("pd.tracing")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pd")
    except Exception:  # not installed as a distribution (a source checkout)
        return "0"


# ------------------------------------------------------------------------------ OTLP protobuf
#
# The protobuf wire format, written by hand (the SDK's encoder builds Python message objects,
# ~45 us a span). Field numbers and types from opentelemetry-proto 1.x (the `.proto` files, as
# `opentelemetry.proto.*_pb2.<Message>.DESCRIPTOR.fields_by_name` reports them):
#
#   collector/trace/v1 ExportTraceServiceRequest: resource_spans = 1 (message)
#   trace/v1 ResourceSpans: resource = 1, scope_spans = 2 (messages)
#   resource/v1 Resource: attributes = 1 (KeyValue)
#   trace/v1 ScopeSpans: scope = 1 (InstrumentationScope), spans = 2 (Span)
#   common/v1 InstrumentationScope: name = 1, version = 2 (strings)
#   trace/v1 Span: trace_id = 1, span_id = 2 (bytes), trace_state = 3 (string),
#     parent_span_id = 4 (bytes), name = 5 (string), kind = 6 (enum), start_time_unix_nano = 7,
#     end_time_unix_nano = 8 (fixed64), attributes = 9 (KeyValue), events = 11 (Event),
#     links = 13 (Link), status = 15 (Status), flags = 16 (fixed32)
#   trace/v1 Span.Event: time_unix_nano = 1 (fixed64), name = 2 (string), attributes = 3
#   trace/v1 Span.Link: trace_id = 1, span_id = 2 (bytes), trace_state = 3 (string),
#     attributes = 4, flags = 6 (fixed32)
#   trace/v1 Status: message = 2 (string), code = 3 (enum)
#   common/v1 KeyValue: key = 1 (string), value = 2 (AnyValue)
#   common/v1 AnyValue: string_value = 1, bool_value = 2, int_value = 3 (int64),
#     double_value = 4, array_value = 5 (ArrayValue)
#   common/v1 ArrayValue: values = 1 (AnyValue)
#   trace/v1 SpanFlags: the W3C trace flags in bits 0-7; 0x100: has is_remote; 0x200: is remote
#
# A tag is (field << 3 | wire type): 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32.

_VARINT_1 = [bytes((n,)) for n in range(128)]
_INT64_LIMIT = 1 << 63
_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack
_pack_i = struct.Struct("<I").pack
_SPAN_TIMES = struct.Struct("<BQBQ").pack  # tag 7, start; tag 8, end (fixed64 both)
_FLAGS_LOCAL = b"\x85\x01" + _pack_i(0x101)  # tag 16 (fixed32): sampled, parent not remote
_FLAGS_REMOTE = b"\x85\x01" + _pack_i(0x301)  # ... parent remote
_LINK_FLAGS = {  # Link.flags (tag 6, fixed32) by (remote, sampled)
    (r, s): b"\x35" + _pack_i(0x100 | (0x200 if r else 0) | (1 if s else 0))
    for r in (False, True)
    for s in (False, True)
}
_KIND_FIELDS = {k: b"\x30" + _VARINT_1[k] for k in _KIND_NAMES}  # tag 6 (varint)
_TRUE, _FALSE = b"\x10\x01", b"\x10\x00"  # AnyValue.bool_value (tag 2)
_CACHE_LIMIT = 4096  # distinct attribute keys / string values / names kept encoded


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _VARINT_1[n]
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: its tag, the body's length, the body."""
    return tag + _varint(len(body)) + body


def _any_value(value: object) -> bytes:
    """An AnyValue's body."""
    if type(value) is str:
        return _field(b"\x0a", value.encode("utf-8", "replace"))
    if type(value) is bool:
        return _TRUE if value else _FALSE
    if type(value) is int:
        if -_INT64_LIMIT <= value < _INT64_LIMIT:
            return b"\x18" + _varint(value & _LOW64)  # int64: two's complement, 10 bytes if < 0
        return _field(b"\x0a", str(value).encode("utf-8", "replace"))  # beyond int64: its digits
    if type(value) is float:
        return b"\x21" + _pack_d(value)
    if isinstance(value, (list, tuple)):
        return _field(b"\x2a", b"".join([_field(b"\x0a", _any_value(v)) for v in value]))
    if value is None:  # in an array: an empty AnyValue
        return b""
    # others as the type they stand for: a str enum, an IntEnum or numpy integer, a numpy float
    if isinstance(value, str):
        return _any_value(str.__str__(value))  # its characters (str() may say "Class.MEMBER")
    try:
        return _any_value(operator.index(value))  # type: ignore[arg-type]
    except TypeError:
        pass
    if hasattr(type(value), "__float__"):
        return _any_value(float(value))  # type: ignore[arg-type]
    return _field(b"\x0a", str(value).encode("utf-8", "replace"))  # anything else: its str


class _Encoder:
    """Serializes batches of spans into `ExportTraceServiceRequest`s for one resource."""

    def __init__(
        self, resource: Mapping[str, AttributeValue], scope_name: str, scope_version: str
    ) -> None:
        self._keys: dict[str, bytes] = {}  # attribute key -> KeyValue.key field
        self._strings: dict[str, bytes] = {}  # string value -> KeyValue.value field
        self._names: dict[str, bytes] = {}  # span name -> Span.name field
        # (key, str or int value) -> Span.attributes field
        self._fields: dict[tuple[str, object], bytes] = {}
        resource_body = b"".join([_field(b"\x0a", self._kv(k, v)) for k, v in resource.items()])
        scope_body = _field(b"\x0a", scope_name.encode("utf-8", "replace")) + _field(
            b"\x12", scope_version.encode("utf-8", "replace")
        )
        self._resource_field = _field(b"\x0a", resource_body)  # ResourceSpans.resource
        self._scope_field = _field(b"\x0a", scope_body)  # ScopeSpans.scope

    def _kv(self, key: str, value: object) -> bytes:
        """A KeyValue's body; keys and short string values are kept encoded."""
        k = self._keys.get(key)
        if k is None:
            k = _field(b"\x0a", key.encode("utf-8", "replace"))
            if len(self._keys) < _CACHE_LIMIT:
                self._keys[key] = k
        if type(value) is str:
            v = self._strings.get(value)
            if v is None:
                v = _field(b"\x12", _field(b"\x0a", value.encode("utf-8", "replace")))
                if len(value) <= 128 and len(self._strings) < _CACHE_LIMIT:
                    self._strings[value] = v
            return k + v
        return k + _field(b"\x12", _any_value(value))

    def _attributes(self, tag: bytes, attributes: Mapping[str, object]) -> list[bytes]:
        kv = self._kv
        return [_field(tag, kv(k, v)) for k, v in attributes.items() if v is not None]

    def span(self, s: _Recording) -> bytes:
        """One Span message's body."""
        name = self._names.get(s._name)
        if name is None:
            name = _field(b"\x2a", s._name.encode("utf-8", "replace"))
            if len(self._names) < _CACHE_LIMIT:
                self._names[s._name] = name
        parts = [b"\x0a\x10", s._trace_id.to_bytes(16, "big"), b"\x12\x08",
                 s._span_id.to_bytes(8, "big")]  # fmt: skip
        if s._tracestate:
            parts.append(_field(b"\x1a", s._tracestate.encode("utf-8", "replace")))
        if s._parent_id:
            parts += (b"\x22\x08", s._parent_id.to_bytes(8, "big"))
        parts += (name, _KIND_FIELDS[s._kind], _SPAN_TIMES(0x39, s._start, 0x41, s._end))
        if s._attributes:
            fields, kv = self._fields, self._kv
            for k, v in s._attributes.items():
                if type(v) is str or type(v) is int:  # (k, True) is never looked up: a bool
                    f = fields.get((k, v))
                    if f is None:
                        f = _field(b"\x4a", kv(k, v))
                        if len(fields) >= _CACHE_LIMIT:
                            fields.clear()  # request ids and the like: start afresh
                        fields[k, v] = f
                    parts.append(f)
                elif v is not None:
                    parts.append(_field(b"\x4a", kv(k, v)))
        if s._events:
            for e in s._events:
                body = (
                    b"\x09"
                    + _pack_q(e.timestamp)
                    + _field(b"\x12", e.name.encode("utf-8", "replace"))
                )
                if e.attributes:
                    body += b"".join(self._attributes(b"\x1a", e.attributes))
                parts.append(_field(b"\x5a", body))
        if s._links:
            for c in s._links:
                body = (
                    b"\x0a\x10"
                    + c.trace_id.to_bytes(16, "big")
                    + b"\x12\x08"
                    + c.span_id.to_bytes(8, "big")
                )
                if c.trace_state:
                    body += _field(b"\x1a", c.trace_state.encode("utf-8", "replace"))
                parts.append(_field(b"\x6a", body + _LINK_FLAGS[c.is_remote, c.sampled]))
        if s._status:
            status = b"\x18" + _VARINT_1[s._status]
            if s._message:
                status = _field(b"\x12", s._message.encode("utf-8", "replace")) + status
            parts.append(_field(b"\x7a", status))
        parts.append(_FLAGS_REMOTE if s._remote else _FLAGS_LOCAL)
        return b"".join(parts)

    def request(self, spans: Iterable[_Recording]) -> tuple[bytes, int]:
        """An ExportTraceServiceRequest (one ResourceSpans, one ScopeSpans) of these spans, and
        how many were left out as they could not be encoded (an attribute key not a str)."""
        span, parts, bad = self.span, [self._scope_field], 0
        for s in spans:
            try:
                parts.append(_field(b"\x12", span(s)))
            except Exception:
                bad += 1
        resource_spans = self._resource_field + _field(b"\x12", b"".join(parts))
        return _field(b"\x0a", resource_spans), bad


# ------------------------------------------------------------------------------ OTLP/HTTP


class _Refused(Exception):
    pass


class _OtlpHttp:
    """POSTs to one OTLP/HTTP traces URL over a keep-alive connection (http.client), once
    more on a fresh connection when the first try fails to connect or the connection broke."""

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str],
        compression: str | None,
        tls: ssl.SSLContext | None,
        timeout_s: float = EXPORT_TIMEOUT_S,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the OTLP endpoint {url!r} is not an http:// or https:// URL")
        self.url = url
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._tls = tls
        self._timeout = timeout_s
        self._compression = compression
        self._headers = {
            "User-Agent": f"pd-tracing/{_version()}",
            **headers,
            "Content-Type": "application/x-protobuf",
        }
        if compression == "gzip":
            self._headers["Content-Encoding"] = "gzip"
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout,
                context=self._tls or ssl.create_default_context(),
            )  # fmt: skip
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def send(self, body: bytes) -> None:
        """POST one request; raises when it did not get through (or was refused)."""
        if self._compression == "gzip":
            body = gzip.compress(body, compresslevel=6, mtime=0)
        for attempt in (1, 2):
            try:
                if self._conn is None:
                    self._conn = self._connect()
                self._conn.request("POST", self._path, body, self._headers)
                response = self._conn.getresponse()
                answer = response.read()
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt == 2:
                    raise
                continue
            if response.will_close:
                self.close()
            if not 200 <= response.status < 300:
                raise _Refused(f"HTTP {response.status}: {answer[:200]!r}")
            return
