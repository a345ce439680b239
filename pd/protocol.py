"""The wire protocol shared by router and workers, defined once.

- OpenAI-style errors (`APIError` -> `{"error": {"message", "type", "code", "param"}}`).
- Parsed and validated OpenAI requests (`CompletionRequest`, `ChatCompletionRequest`).
- `WorkerLoad`: the load a worker reports in `/health`, read by the router's policies.
- `KVTransferParams`: what P returns and D consumes (DESIGN.md §3), versioned.

Validation happens here, at the edge; everything past `parse_*` may trust its types.
"""

from __future__ import annotations

import logging
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

if TYPE_CHECKING:
    from pd.tools_protocol import ToolRequest

log = logging.getLogger("pd.protocol")

# --------------------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error answered to an HTTP client as an OpenAI-style JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


MAX_JSON_DEPTH = 64  # containers nested in a body, or in JSON a server parses from a string


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body; anything but a JSON object, or one nested deeper than
    MAX_JSON_DEPTH, is a 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    if json_too_deep(raw, body):
        raise bad_request(
            f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        )
    return body


def require_json(method: str, has_body: bool, content_type: str) -> None:
    """A POST with a body must say `application/json` (a 415 otherwise, as vLLM answers): a
    browser's form or text POST from another site never reaches a handler (CSRF)."""
    if method == "POST" and has_body and content_type != "application/json":
        raise APIError(
            415,
            f"a request body must be JSON: send 'Content-Type: application/json', not "
            f"{content_type!r}",
            code="unsupported_media_type",
        )


def json_too_deep(raw: bytes | str, value: Any, most: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value`, parsed from `raw`, nests more than `most` objects and arrays. Most
    bodies hold fewer brackets than that (counted in C); the others are walked without
    recursion, skipping lists of scalars (a prompt's ids) in C."""
    opens = (
        raw.count("[") + raw.count("{")
        if isinstance(raw, str)
        else (raw.count(b"[") + raw.count(b"{"))
    )
    if opens <= most or not isinstance(value, (dict, list)):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > most:
            return True
        items = list(x.values()) if isinstance(x, dict) else x
        kinds = set(map(type, items))
        if dict in kinds or list in kinds:
            stack.extend((y, depth + 1) for y in items if isinstance(y, (dict, list)))
    return False


def header_bytes(value: str) -> bytes:
    """A header value as the bytes the client sent (aiohttp decodes them as UTF-8 with
    surrogateescape): compared and hashed as bytes, never a UnicodeEncodeError."""
    try:
        return value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace")


# ----------------------------------------------------------------------------- field validators


def _opt(body: dict, name: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python: refuse it where a number is wanted, and vice versa.
    is_bool = isinstance(value, bool)
    wants_bool = types is bool or (isinstance(types, tuple) and bool in types)
    if not isinstance(value, types) or (is_bool and not wants_bool):
        names = (
            types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        )
        raise bad_request(f"'{name}' must be of type {names}", param=name, code="invalid_type")
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"'{name}' must be a finite number", param=name)
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = float(_opt(body, name, (int, float), default))
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return value


def _int(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = _opt(body, name, int, default)
    if value is None:
        return None
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"'{name}' must be {bound}, got {value}", param=name)
    return value


# Token ids are int32 everywhere past the edge (torch, the router's index): larger ones are a 400
# here, before any vocabulary check.
MAX_TOKEN_ID = (1 << 31) - 1


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    ):
        raise bad_request(
            f"'{name}' must be a list of token ids (integers in 0..{MAX_TOKEN_ID})", param=name
        )
    return value


# ------------------------------------------------------------------------------------ requests


MAX_TOP_LOGPROBS = 20  # as OpenAI and vLLM
MAX_N = 16  # choices a request may ask for (`n`)
MAX_PROMPTS = 64  # prompts a completions request may list
# Choices one request may ask for in all (prompts x n): forks of a prompt join the running batch
# beside their parent, past --max-waiting-requests, so one request's share is bounded here.
MAX_CHOICES = 64
MAX_LOGIT_BIAS = 1024  # token ids a logit_bias may name (OpenAI allows 300)
# Lists a request may send, each checked on every token or step (docs/security.md): far above
# what clients send (OpenAI allows 4 stop strings; lm-eval sends a few), far below a stall.
MAX_STOP = 128  # stop strings
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_BAD_WORDS = 256  # vLLM's bad_words
MAX_BAD_WORD_CHARS = 128
MAX_STOP_TOKEN_IDS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # vLLM's allowed_token_ids: a vocabulary's worth (262,144)
MAX_MESSAGES = 4096  # chat messages
# The longest text /tokenize counts: tokenizers holds the GIL ~30 ms a MiB (the event loop waits
# that long: `pd-bench stall --kinds tokenize`), and 1 MiB is past any prompt of an 8k context
# (8192 tokens x 82 bytes a token at most, for SmolLM2).
MAX_TOKENIZE_CHARS = 1 << 20
MAX_CACHE_SALT_CHARS = 256
# Below this temperature sampling is greedy (as in vLLM): logits / temperature would overflow.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match (structured outputs). `kind` is one of `KINDS`; `spec`
    its text: a JSON schema (serialized), nothing (any JSON object), a regex, a JSON list of
    choices, or a Lark or GBNF grammar. Compiled by the workers (pd/worker/text/grammar.py)."""

    kind: str
    spec: str = ""

    KINDS: ClassVar[tuple[str, ...]] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GenerationOptions:
    """A request's sampling and stopping options: one type from the HTTP edge to the sampler.

    Built by `parse_request`, which validates every field; past it they are trusted. Torch-free,
    so the router reads it too.
    """

    max_tokens: int | None = None  # None: up to the context length (the worker resolves it)
    temperature: float = 1.0  # 0 (or < GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = -1  # -1 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    presence_penalty: float = 0.0  # OpenAI, over output tokens, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI, over output tokens, in [-2, 2]
    repetition_penalty: float = 1.0  # HF/vLLM, over prompt + output tokens; 1 = off
    seed: int | None = None  # same seed -> same text, however the request is served
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # report the chosen token's logprob
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS most likely alternatives per position
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # structured outputs: what the output must match
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, bias in [-100, 100])
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are out
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: the only tokens it may sample
    bad_words: tuple[str, ...] = ()  # vLLM's: words whose tokens are never completed
    include_stop_str_in_output: bool = False  # vLLM's: keep the matched stop string
    # The prompt's logprobs, with this many alternatives a position (None: not computed): for
    # vLLM's `prompt_logprobs`, and for completions' `echo` with `logprobs` (the larger of the
    # two). A request that asks skips the prefix cache's match: a cached page has no logits.
    prompt_logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


def _parse_options(
    body: dict,
    max_tokens_names: tuple[str, ...],
    default_max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    prompt_logprobs: int | None = None,
    echo: bool = False,
) -> GenerationOptions:
    max_tokens = default_max_tokens
    for name in max_tokens_names:
        # 0 only with echo (as vLLM): the prompt and its logprobs, nothing generated.
        value = _int(body, name, None, 0 if echo else 1)
        if value is not None:
            max_tokens = value
            break
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise bad_request("'stop' must be a string or a list of strings", param="stop")
    if any(s == "" for s in stop):
        raise bad_request("'stop' strings must not be empty", param="stop")
    _bound(stop, "stop", MAX_STOP, "strings", MAX_STOP_CHARS)
    stop_token_ids = body.get("stop_token_ids")
    stop_token_ids = tuple(_token_ids(stop_token_ids, "stop_token_ids")) if stop_token_ids else ()
    _bound(stop_token_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS, "token ids")
    bad_words = _strings(body, "bad_words")
    _bound(bad_words, "bad_words", MAX_BAD_WORDS, "words", MAX_BAD_WORD_CHARS)
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        _bound(allowed, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, "token ids")
        allowed = tuple(_token_ids(allowed, "allowed_token_ids"))
    best_of = _int(body, "best_of", 1, 1)
    if best_of != 1:
        raise bad_request("only best_of=1 is supported", param="best_of", code="unsupported_value")
    seed = _opt(body, "seed", int)
    n: int = body["n"] if type(body.get("n")) is int else 1
    if seed is not None and not -(1 << 63) <= seed <= (1 << 63) - max(1, n):
        # Choice i samples with seed + i, in every request that carries it (migration legs).
        raise bad_request(
            "'seed' must be a signed 64-bit integer, and seed + n - 1 too", param="seed"
        )
    top_k = _int(body, "top_k", -1, -1)
    assert top_k is not None  # it has a default
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:  # OpenAI allows 0: the limit is "the most likely token only"
        temperature, top_p = 0.0, 1.0
    return GenerationOptions(
        constraint=parse_constraint(body),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_tokens=_int(body, "min_tokens", 0, 0) or 0,
        allowed_token_ids=allowed,
        bad_words=bad_words,
        include_stop_str_in_output=bool(_opt(body, "include_stop_str_in_output", bool, False)),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if top_k == 0 else top_k,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        seed=seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(_opt(body, "ignore_eos", bool, False)),
        skip_special_tokens=bool(_opt(body, "skip_special_tokens", bool, True)),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` (JSON keys are strings), each bias in [-100, 100]."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids to biases",
            param="logit_bias",
        )
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token <= MAX_TOKEN_ID or str(token) != str(key).strip():
            raise bad_request(f"'logit_bias' key {_clip(key)} is not a token id", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(
                f"'logit_bias' of token {token} must be a number in [-100, 100]", "logit_bias"
            )
        out.append((token, float(bias)))
    return tuple(out)


def _bound(values: Any, name: str, most: int, what: str, most_chars: int | None = None) -> None:
    """A 400 for a list longer than `most` (or, for strings, one longer than `most_chars`)."""
    if isinstance(values, (list, tuple)) and len(values) > most:
        raise bad_request(f"'{name}' may hold at most {most} {what}, got {len(values)}", param=name)
    if most_chars is not None and any(len(v) > most_chars for v in values):
        raise bad_request(
            f"each of '{name}' may be at most {most_chars} characters long", param=name
        )


def _strings(body: dict, name: str) -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise bad_request(f"'{name}' must be a list of non-empty strings", param=name)
    return tuple(value)


# Structured-output fields (OpenAI's, vLLM's, SGLang's) -> the constraint kind each asks for.
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "json_schema": "json_schema",  # SGLang
    "regex": "regex",  # SGLang
    "ebnf": "grammar",  # SGLang
}
_STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def parse_constraint(body: dict[str, Any]) -> Constraint | None:
    """The one structured-output constraint a body asks for (response_format, vLLM's
    structured_outputs and guided_*, SGLang's regex/ebnf/json_schema), or None; a 400 for a
    malformed one or for two at once."""
    found: list[tuple[str, Constraint]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kinds = ("text", "json_object", "json_schema")
        if not isinstance(fmt, dict) or fmt.get("type") not in kinds:
            raise bad_request(
                "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                param="response_format",
            )
        if fmt["type"] == "json_object":
            found.append(("response_format", Constraint("json_object")))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request(
                    "'response_format.json_schema.schema' must be a JSON schema object",
                    param="response_format",
                )
            found.append(("response_format", _schema_constraint(schema, "response_format")))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict) or not so or not set(so) <= set(_STRUCTURED_OUTPUTS):
            raise bad_request(
                "'structured_outputs' must set one of " + ", ".join(_STRUCTURED_OUTPUTS),
                param="structured_outputs",
            )
        for key, value in so.items():
            if value is not None and value is not False:
                kind = _STRUCTURED_OUTPUTS[key]
                found.append(("structured_outputs", _constraint(kind, value, "structured_outputs")))
    for name, kind in _GUIDED.items():
        value = body.get(name)
        if value is not None:
            found.append((name, _constraint(kind, value, name)))
    if len(found) > 1:
        names = ", ".join(sorted({n for n, _ in found}))
        raise bad_request(f"one structured-output constraint per request, got {names}")
    return found[0][1] if found else None


def _constraint(kind: str, value: Any, param: str) -> Constraint:
    if kind == "json_schema":
        if isinstance(value, str):
            text = value
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError:
                raise bad_request(f"'{param}' must be a JSON schema", param=param) from None
            if json_too_deep(text, value):
                raise bad_request(
                    f"'{param}' nests deeper than {MAX_JSON_DEPTH} levels", param=param
                )
        if not isinstance(value, dict):
            raise bad_request(f"'{param}' must be a JSON schema object", param=param)
        return _schema_constraint(value, param)
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"'{param}.json_object' must be true", param=param)
        return Constraint("json_object")
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise bad_request(f"'{param}' choices must be a non-empty list of strings", param)
        return Constraint("choice", orjson.dumps(value).decode())
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string", param=param)
    return Constraint(kind, value)


def _schema_constraint(schema: dict[str, Any], param: str) -> Constraint:
    try:
        # Keys keep the declared order: properties are generated in that order.
        return Constraint("json_schema", orjson.dumps(schema).decode())
    except TypeError as e:  # e.g. integers past 64 bits
        raise bad_request(f"'{param}' is not a serializable JSON schema: {e}", param) from None


@dataclass
class _RequestBase:
    model: str | None
    options: GenerationOptions
    stream: bool
    include_usage: bool  # stream_options.include_usage
    user: str | None  # also a room key for sticky routing
    session_id: str | None
    kv_transfer_params: dict[str, Any] | None  # set by the router only; opaque here
    # vLLM's `cache_salt`: requests with different salts share no cached KV (enters the first
    # page's hash on the workers and the router's prefix index). None: the shared cache.
    cache_salt: str | None
    n: int  # choices per prompt, 1..MAX_N: the prompt is prefilled once and forked
    raw: dict[str, Any] = field(repr=False)  # the body as received
    # vLLM's `prompt_logprobs` as the client asked (None: not asked; options.prompt_logprobs
    # is what is computed).
    prompt_logprobs: int | None = None
    # The router's `pd_continuation.output_token_ids` (docs/migration.md §3): the output the
    # uninterrupted request had generated; this worker goes on from there. None: a new request.
    continuation: list[int] | None = None

    @property
    def room_key(self) -> str | None:
        return self.user or self.session_id


def _parse_common(body: dict) -> dict[str, Any]:
    stream = bool(_opt(body, "stream", bool, False))
    stream_options = _opt(body, "stream_options", dict, {})
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    kvp = _opt(body, "kv_transfer_params", dict)
    salt = _opt(body, "cache_salt", str)
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            param="cache_salt",
        )
    n = _int(body, "n", 1, 1, MAX_N) or 1
    return dict(
        model=_opt(body, "model", str),
        stream=stream,
        include_usage=include_usage,
        user=_opt(body, "user", str),
        session_id=_opt(body, "session_id", str),
        kv_transfer_params=kvp,
        cache_salt=salt,
        n=n,
        raw=body,
        continuation=parse_continuation(body.get("pd_continuation"), n),
    )


def parse_continuation(value: Any, n: int = 1) -> list[int] | None:
    """`pd_continuation` (set by the router only: docs/migration.md §3): its output token ids,
    or None when absent. Whether the ids fit this worker (vocabulary, context) and agree with
    `kv_transfer_params` is the worker's check."""
    if value is None:
        return None
    param = "pd_continuation"
    if not isinstance(value, dict):
        raise bad_request("'pd_continuation' must be an object", param)
    # (`pd_sig`: the router's signature, pd/signing.py checks it)
    unknown = sorted(k for k in value if k not in ("output_token_ids", "pd_sig"))
    if unknown:
        raise bad_request(f"'pd_continuation' has unknown keys: {', '.join(unknown)}", param)
    ids: Any = value.get("output_token_ids")
    if not _is_ids(ids):
        raise bad_request(
            f"'pd_continuation.output_token_ids' must be a list of token ids (0..{MAX_TOKEN_ID})",
            param,
        )
    if n != 1:
        raise bad_request(f"'pd_continuation' continues one choice: n must be 1, not {n}", param)
    return [int(t) for t in ids]


@dataclass
class CompletionRequest(_RequestBase):
    prompt: str | list[int] = ""  # text, or token ids (with `batch`: its first prompt)
    echo: bool = False
    # A list of 2..MAX_PROMPTS prompts (None: one prompt, `prompt`): answered as one choice list,
    # choice `prompt_index * n + choice_index` (vLLM's order).
    batch: list[str | list[int]] | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> CompletionRequest:
        if "prompt" not in body:
            raise bad_request("'prompt' is required", param="prompt", code="missing_field")
        prompt = body["prompt"]
        batch: list[str | list[int]] | None = None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > MAX_PROMPTS:
                raise bad_request(
                    f"'prompt' may be a list of at most {MAX_PROMPTS} prompts, got {len(prompt)}",
                    param="prompt",
                )
            batch = [_one_prompt(p) for p in prompt]
            prompt = batch[0]
            if len(batch) == 1:
                batch = None  # a batch of one: answered as a single prompt
        else:
            prompt = _one_prompt(prompt)
        n = _int(body, "n", 1, 1, MAX_N) or 1
        if batch is not None and len(batch) * n > MAX_CHOICES:
            raise bad_request(
                f"{len(batch)} prompts x n={n} is {len(batch) * n} choices; at most "
                f"{MAX_CHOICES} a request",
                param="n",
            )
        logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        echo = bool(_opt(body, "echo", bool, False))
        asked = _prompt_logprobs(body)
        computed = asked
        if echo and logprobs is not None:  # the echoed prompt's logprobs, as vLLM computes them
            computed = max(asked or 0, logprobs)
        options = _parse_options(
            body,
            ("max_tokens",),
            16,  # OpenAI's default for completions
            logprobs is not None,
            logprobs or 0,
            computed,
            echo,
        )
        return cls(
            prompt=prompt,
            options=options,
            echo=echo,
            prompt_logprobs=asked,
            batch=batch,
            **_parse_common(body),
        )


def _prompt_logprobs(body: dict) -> int | None:
    """vLLM's `prompt_logprobs`: alternatives per prompt position, 0..MAX_TOP_LOGPROBS."""
    return _int(body, "prompt_logprobs", None, 0, MAX_TOP_LOGPROBS)


def _one_prompt(prompt: Any) -> str | list[int]:
    """One prompt of a completions request: a non-empty text or list of token ids."""
    if isinstance(prompt, list):
        prompt = _token_ids(prompt, "prompt")
        if not prompt:
            raise bad_request("'prompt' must not be empty", param="prompt")
    elif not isinstance(prompt, str):
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a list of those",
            param="prompt",
            code="invalid_type",
        )
    elif not prompt:
        raise bad_request("'prompt' must not be empty", param="prompt")
    return prompt


_ROLES = ("system", "user", "assistant", "tool", "developer")


def _parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    _bound(value, "messages", MAX_MESSAGES, "messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise bad_request(f"'messages[{i}]' must be an object", param="messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"'messages[{i}].role' must be one of {', '.join(_ROLES)}", param="messages"
            )
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise bad_request(
                        f"'messages[{i}].content' supports only text parts", param="messages"
                    )
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"'messages[{i}]' text part needs 'text'", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"'messages[{i}].content' must be a string", param="messages")
        if role == "tool" or m.get("tool_calls") is not None:
            from pd.tools_protocol import check_tool_message  # (it imports this module)

            check_tool_message(i, m)
        messages.append({**m, "content": content})
    return messages


@dataclass
class ChatCompletionRequest(_RequestBase):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: ToolRequest | None = None  # tools, tool_choice, parallel_tool_calls (tools_protocol)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> ChatCompletionRequest:
        from pd.tools_protocol import parse_tools  # (it imports this module)

        if "messages" not in body:
            raise bad_request("'messages' is required", param="messages", code="missing_field")
        messages = _parse_messages(body["messages"])
        logprobs = bool(_opt(body, "logprobs", bool, False))
        if not logprobs and body.get("top_logprobs") is not None:
            raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        top_logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) if logprobs else 0
        assert top_logprobs is not None  # it has a default
        if body.get("echo") not in (None, False):  # vLLM echoes the last message: not here
            raise bad_request(
                "'echo' is served on /v1/completions only", param="echo", code="unsupported_value"
            )
        asked = _prompt_logprobs(body)
        options = _parse_options(
            body, ("max_completion_tokens", "max_tokens"), None, logprobs, top_logprobs, asked
        )
        tools = parse_tools(body)
        if tools is not None and tools.constrained:  # the output is the call(s): constrained
            if options.constraint is not None:
                raise bad_request(
                    f"'tool_choice' {tools.choice!r} constrains the output to tool calls: it "
                    "cannot be combined with another structured-output constraint",
                    param="tool_choice",
                )
            options = replace(options, constraint=tools.constraint())
        return cls(
            messages=messages,
            options=options,
            tools=tools,
            prompt_logprobs=asked,
            **_parse_common(body),
        )


def parse_request(
    path: str, body: dict[str, Any], *, ignore_unknown_fields: bool = False
) -> CompletionRequest | ChatCompletionRequest:
    """Parse a body for `/v1/completions` or `/v1/chat/completions`: every field checked against
    `FIELDS` first (refused and unknown fields are 400s), then each served one validated."""
    chat = path.endswith("/chat/completions")
    check_fields(body, chat, ignore_unknown_fields)
    if chat:
        return ChatCompletionRequest.parse(body)
    return CompletionRequest.parse(body)


# ---------------------------------------------------------------------------- the field table

SERVED, ACCEPTED, REFUSED = "served", "accepted", "refused"


@dataclass(frozen=True)
class FieldRule:
    """What pd does with one request field (docs/api.md lists the same table).

    served: it changes the output as it says (validated by the parsers above); accepted: it
    does nothing here and changes no output (OpenAI platform fields such as `store`); refused: a
    400 `unsupported_parameter`, unless its value is `noop` (the value that asks for nothing, such
    as `echo: false`): nothing that would change the output is accepted and ignored."""

    status: str
    note: str
    endpoint: str = "both"  # "both", "chat" or "completions"
    noop: tuple[Any, ...] = ()  # values of a refused field that ask for nothing


def _rule(status: str, note: str, endpoint: str = "both", *noop: Any) -> FieldRule:
    return FieldRule(status, note, endpoint, noop)


_SAMPLING = "sampling (vLLM extra)"
FIELDS: dict[str, FieldRule] = {
    # -- the prompt
    "messages": _rule(SERVED, "the conversation, rendered by the model's chat template", "chat"),
    "prompt": _rule(SERVED, "text or token ids, or a list of up to 64 of those (prompts x n at "
                    "most 64)", "completions"),
    "model": _rule(SERVED, "checked against the served names (404 otherwise)"),
    # -- length and stopping
    "max_tokens": _rule(SERVED, "completions: 16 by default, 0 only with echo; chat: the rest "
                        "of the context"),
    "max_completion_tokens": _rule(SERVED, "wins over max_tokens", "chat"),
    "stop": _rule(SERVED, "strings; cut from the output"),
    "stop_token_ids": _rule(SERVED, "vLLM extra"),
    "ignore_eos": _rule(SERVED, "vLLM extra"),
    "min_tokens": _rule(SERVED, "vLLM extra: EOS and stop ids are masked until this many tokens"),
    "include_stop_str_in_output": _rule(SERVED, "vLLM extra: the matched stop string is kept"),
    # -- sampling
    "temperature": _rule(SERVED, "0 (or below 1e-5) is greedy; at most 2"),
    "top_p": _rule(SERVED, "0 means greedy"),
    "top_k": _rule(SERVED, _SAMPLING),
    "min_p": _rule(SERVED, _SAMPLING),
    "presence_penalty": _rule(SERVED, "over the output tokens"),
    "frequency_penalty": _rule(SERVED, "over the output tokens"),
    "repetition_penalty": _rule(SERVED, "vLLM extra: over prompt and output tokens"),
    "seed": _rule(SERVED, "the same text however the request is batched or routed"),
    "n": _rule(SERVED, "1..16 choices; the prompt is prefilled once"),
    "best_of": _rule(SERVED, "1 only (400 otherwise)", "completions"),
    "logit_bias": _rule(SERVED, "added to the logits of the named token ids, each in [-100, 100]"),
    "allowed_token_ids": _rule(SERVED, "vLLM extra: the only tokens it may sample (and stopping)"),
    "bad_words": _rule(SERVED, "vLLM extra: a word's last token is never sampled after the rest"),
    "use_beam_search": _rule(REFUSED, "vLLM extra: no beam search", "both", False),
    "length_penalty": _rule(REFUSED, "vLLM extra: no beam search", "both", 1, 1.0),
    "logits_processors": _rule(REFUSED, "vLLM extra: no custom logits processors"),
    # -- logprobs
    "logprobs": _rule(SERVED, "chat: a boolean; completions: 0..20 alternatives"),
    "top_logprobs": _rule(SERVED, "0..20, with logprobs: true", "chat"),
    "prompt_logprobs": _rule(SERVED, "vLLM extra: 0..20 alternatives per prompt position"),
    "echo": _rule(SERVED, "completions: the prompt before the completion (with logprobs: "
                  "theirs first); chat: false only"),
    "return_tokens_as_token_ids": _rule(REFUSED, "vLLM extra: not served", "both", False),
    "return_token_ids": _rule(REFUSED, "vLLM extra: not served", "both", False),
    # -- structured outputs and tools
    "response_format": _rule(SERVED, "json_object, json_schema (strict or not) constrain it"),
    "structured_outputs": _rule(SERVED, "vLLM extra: json, regex, choice, grammar or json_object"),
    "guided_json": _rule(SERVED, "vLLM extra: the older form of structured_outputs.json"),
    "guided_regex": _rule(SERVED, "vLLM extra: the older form of structured_outputs.regex"),
    "guided_choice": _rule(SERVED, "vLLM extra: the older form of structured_outputs.choice"),
    "guided_grammar": _rule(SERVED, "vLLM extra: a Lark or GBNF grammar"),
    "structural_tag": _rule(REFUSED, "vLLM extra: structured outputs, not served yet"),
    "guided_decoding_backend": _rule(ACCEPTED, "vLLM extra: one backend here, llguidance"),
    "guided_whitespace_pattern": _rule(REFUSED, "vLLM extra: structured outputs, not served"),
    "regex": _rule(SERVED, "SGLang extra: a regex the output matches"),
    "ebnf": _rule(SERVED, "SGLang extra: a GBNF grammar"),
    "json_schema": _rule(SERVED, "SGLang extra: a JSON schema (as a string)"),
    "tools": _rule(SERVED, "function tools, rendered by the chat template (or pd's default "
                   "tool prompt); calls parsed into message.tool_calls", "chat"),
    "tool_choice": _rule(SERVED, "none, auto, required or a named function (the last two "
                         "constrain the output to calls)", "chat"),
    "functions": _rule(REFUSED, "deprecated tool calling: not served (use tools)", "chat", []),
    "function_call": _rule(REFUSED, "deprecated tool calling: not served (use tool_choice)",
                           "chat", "none"),
    "parallel_tool_calls": _rule(SERVED, "false: at most one call", "chat"),
    # -- the chat template
    "add_generation_prompt": _rule(REFUSED, "vLLM extra: always true here", "chat", True),
    "continue_final_message": _rule(REFUSED, "vLLM extra: not served yet", "chat", False),
    "chat_template": _rule(REFUSED, "vLLM extra: the model's template only", "chat"),
    "chat_template_kwargs": _rule(REFUSED, "vLLM extra: not served yet", "chat", {}),
    "documents": _rule(REFUSED, "vLLM extra: not served", "chat", []),
    "add_special_tokens": _rule(REFUSED, "vLLM extra: never added here", "both", False),
    "mm_processor_kwargs": _rule(REFUSED, "vLLM extra: text only", "chat", {}),
    "truncate_prompt_tokens": _rule(REFUSED, "vLLM extra: prompts are never truncated"),
    "suffix": _rule(REFUSED, "fill-in-the-middle is not served (as in vLLM)", "completions", ""),
    # -- output form
    "stream": _rule(SERVED, "SSE with data: [DONE]"),
    "stream_options": _rule(SERVED, "include_usage; only with stream: true"),
    "skip_special_tokens": _rule(SERVED, "vLLM extra"),
    "spaces_between_special_tokens": _rule(REFUSED, "vLLM extra: not served", "both", True),
    "modalities": _rule(REFUSED, "text only", "chat", ["text"]),
    "audio": _rule(REFUSED, "text only", "chat"),
    "reasoning_effort": _rule(REFUSED, "no reasoning models here", "chat"),
    "verbosity": _rule(REFUSED, "not served", "chat"),
    "web_search_options": _rule(REFUSED, "no web search", "chat"),
    "prediction": _rule(ACCEPTED, "predicted outputs speed OpenAI's answers up; the answer "
                        "is the same without it", "chat"),
    # -- scheduling, caching, tenancy
    "priority": _rule(REFUSED, "vLLM extra: no priority scheduling", "both", 0),
    "cache_salt": _rule(SERVED, "vLLM extra: isolates the prefix cache (docs/security.md)"),
    "user": _rule(SERVED, "a room key for sticky routing"),
    "session_id": _rule(SERVED, "pd extra: a room key for sticky routing"),
    "prompt_cache_key": _rule(ACCEPTED, "OpenAI's cache-routing hint; pd routes by the prompt"),
    "safety_identifier": _rule(ACCEPTED, "OpenAI platform field"),
    "kv_transfer_params": _rule(SERVED, "pd-internal: set by the router only"),
    "pd_continuation": _rule(SERVED, "pd-internal: set by the router only"),
    "request_id": _rule(ACCEPTED, "vLLM extra: pd makes its own ids"),
    "rid": _rule(ACCEPTED, "SGLang extra: pd makes its own ids"),
    "vllm_xargs": _rule(REFUSED, "vLLM extra: not served"),
    # -- OpenAI platform fields
    "store": _rule(ACCEPTED, "OpenAI platform field: nothing is stored"),
    "metadata": _rule(ACCEPTED, "OpenAI platform field (with store)"),
    "service_tier": _rule(ACCEPTED, "OpenAI platform field: one tier here"),
}  # fmt: skip
STREAM_OPTIONS = {"include_usage": SERVED, "continuous_usage_stats": REFUSED}
_warned_unknown: set[str] = set()


def check_fields(body: dict[str, Any], chat: bool, ignore_unknown: bool = False) -> None:
    """Refuse (400 `unsupported_parameter`) a field pd does not serve, and (as OpenAI does) one
    it does not know, unless `ignore_unknown` (vLLM's way: accepted, and logged once per name).
    A field set to null counts as absent."""
    unknown = set(unknown_fields(body, chat))
    for name, value in body.items():
        if value is None:
            continue
        if name in unknown:
            if ignore_unknown:
                _warn_unknown(name)
                continue
            raise unknown_parameter(name)
        rule = FIELDS[name]
        if rule.status == REFUSED and not any(value == v for v in rule.noop):
            raise unsupported_parameter(name, rule.note)
    options = body.get("stream_options")
    if isinstance(options, dict) and options:
        if body.get("stream") is not True:
            raise bad_request(
                "'stream_options' is only allowed with 'stream': true", param="stream_options"
            )
        for name, value in options.items():
            status = STREAM_OPTIONS.get(name)
            if status == REFUSED and value not in (None, False):
                raise APIError(
                    400,
                    f"'stream_options.{name}' is not supported by this server",
                    code="unsupported_parameter",
                    param="stream_options",
                )
            if status is None and not ignore_unknown:
                raise APIError(
                    400,
                    f"Unrecognized request argument supplied: stream_options.{name[:64]}",
                    code="unknown_parameter",
                    param="stream_options",
                )


def unknown_parameter(name: str) -> APIError:
    """The 400 of a field pd does not know (OpenAI's words)."""
    return APIError(
        400,
        f"Unrecognized request argument supplied: {name[:64]}",
        code="unknown_parameter",
        param=name[:64],
    )


def unsupported_parameter(name: str, why: str) -> APIError:
    """The 400 of a field pd knows and does not serve."""
    return APIError(
        400,
        f"'{name}' is not supported by this server ({why})",
        code="unsupported_parameter",
        param=name,
    )


def unknown_fields(body: dict[str, Any], chat: bool) -> list[str]:
    """The fields of `body` that `FIELDS` does not know for its endpoint."""
    endpoint = "chat" if chat else "completions"
    return [
        name
        for name in body
        if (rule := FIELDS.get(name)) is None or rule.endpoint not in ("both", endpoint)
    ]


def _warn_unknown(name: str) -> None:
    if name not in _warned_unknown and len(_warned_unknown) < 1024:  # a client picks the names
        _warned_unknown.add(name)
        log.warning("ignoring unknown request field %r (--ignore-unknown-fields)", _clip(name))


# ----------------------------------------------------------------------------------- load


@dataclass
class WorkerLoad:
    """The load a worker reports in `/health` (and the router's policies read)."""

    role: str  # "prefill" | "decode" | "both"
    running: int  # requests in the running batch
    waiting: int  # requests queued for admission
    queued_prefill_tokens: int  # prompt tokens not yet prefilled (waiting + partially prefilled)
    kv_pages_total: int
    kv_pages_free: int  # what an allocation can have: free plus evictable
    inflight_transfers: int = 0  # P: pinned for D; D: pulling or waiting for pages
    kv_pages_held: int = 0  # pages of those transfers (P: pinned; D: reserved for the pull)
    kv_pages_cached: int = 0  # pages whose KV the prefix cache can match (referenced or not)
    kv_pages_evictable: int = 0  # cached pages nobody holds (counted in kv_pages_free)
    kv_page_size: int = 0  # tokens per page (0: not reported); sizes the router's prefix index
    kv_pages_pinned: int = 0  # P: pages pinned for decode workers to pull
    kv_pages_reserved: int = 0  # D: pages reserved for pulls (transferring, or quarantined)
    waiting_for_pages: int = 0  # D: pulled requests queued until their pages fit

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_pages_free / self.kv_pages_total if self.kv_pages_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerLoad:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# --------------------------------------------------------------------- kv_transfer_params

PD_VERSION = 1


@dataclass
class KVTransferParams:
    """What P answers in `kv_transfer_params` and D consumes (DESIGN.md §3)."""

    remote_engine_id: str
    remote_host: str
    remote_port: int  # P's bootstrap port
    transfer_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    page_ids: dict[str, list[int]]  # per pool name
    num_tokens: int  # tokens whose KV P holds (the prompt, and a continuation's output ids)
    page_size: int
    tp_size: int
    kv_layout: str
    dtype: str
    model_fingerprint: str
    lease_ttl_s: float
    # [logprob, [[token id, logprob], ...]] of the first token when the request asked for them
    first_token_logprobs: list | None = None
    # With n > 1: every choice's first token (first_token_id is the first), all sampled by P from
    # the prompt's last logits, and their logprobs entries (as first_token_logprobs) when asked.
    first_token_ids: list[int] | None = None
    first_tokens_logprobs: list | None = None
    cached_tokens: int = 0  # prompt tokens P's prefix cache served (D reports them in usage)
    # When the request asked for the prompt's logprobs (P computes them as it prefills, D
    # answers them): per prompt token after the first, [logprob, rank, [[token id, logprob],
    # ...]] (that token's logprob and rank at its position, then the most likely alternatives).
    prompt_logprobs: list | None = None
    # A continuation (docs/migration.md §3): the output ids P prefilled after the prompt (its
    # KV covers prompt + these: num_tokens); D's request starts with them as its output.
    output_token_ids: list[int] | None = None
    do_remote_prefill: bool = True
    pd_version: int = PD_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> KVTransferParams:
        """Parse params as D receives them: every field type- and range-checked like a client's
        input (they come in a request body), a 400 on anything else. Whether they fit this worker
        (vocabulary, context, model) is the decode side's check."""
        if not isinstance(d, dict):
            raise bad_request("'kv_transfer_params' must be an object", "kv_transfer_params")
        if d.get("pd_version") != PD_VERSION:
            raise bad_request(
                f"unsupported kv_transfer_params pd_version {d.get('pd_version')!r} "
                f"(this worker speaks {PD_VERSION})",
                "kv_transfer_params",
            )
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = [n for n in required if n not in d]
        if missing:
            raise bad_request(
                f"kv_transfer_params lacks {', '.join(sorted(missing))}", "kv_transfer_params"
            )
        values = {k: d[k] for k in names if k in d}
        for name, value in values.items():
            check, wants = _KV_FIELDS[name]
            if not check(value):
                raise bad_request(
                    f"kv_transfer_params.{name} is not {wants}: {_clip(value)}",
                    "kv_transfer_params",
                )
        return cls(**values)


def _is_int(v: Any, lo: int = 0, hi: int = MAX_TOKEN_ID) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_str(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 256


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _is_logprob(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_first_logprobs(v: Any) -> bool:  # [logprob, [[token id, logprob], ...]]
    if v is None:
        return True
    if not (isinstance(v, list) and len(v) == 2 and _is_logprob(v[0])):
        return False
    top = v[1]
    return top is None or (
        isinstance(top, list)
        and len(top) <= MAX_TOP_LOGPROBS
        and all(
            isinstance(e, list) and len(e) == 2 and _is_int(e[0]) and _is_logprob(e[1]) for e in top
        )
    )


def _is_prompt_logprobs(v: Any) -> bool:  # [[logprob, rank, [[token id, logprob], ...]], ...]
    return v is None or (
        isinstance(v, list)
        and all(
            isinstance(e, list)
            and len(e) == 3
            and _is_logprob(e[0])
            and _is_int(e[1], 1)
            and isinstance(e[2], list)
            and len(e[2]) <= MAX_TOP_LOGPROBS
            and all(
                isinstance(t, list) and len(t) == 2 and _is_int(t[0]) and _is_logprob(t[1])
                for t in e[2]
            )
            for e in v
        )
    )


# Per field of KVTransferParams: its check, and what it must be (for the 400's message).
_KV_FIELDS: dict[str, tuple[Any, str]] = {
    "remote_engine_id": (_is_str, "a string of 1..256 characters"),
    "remote_host": (_is_str, "a host name or address"),
    "remote_port": (lambda v: _is_int(v, 1, 65535), "a port (1..65535)"),
    "transfer_id": (_is_str, "a string of 1..256 characters"),
    "prompt_token_ids": (
        lambda v: _is_ids(v) and len(v) > 0,
        f"a non-empty list of token ids (0..{MAX_TOKEN_ID})",
    ),
    "first_token_id": (_is_int, f"a token id (0..{MAX_TOKEN_ID})"),
    "page_ids": (
        lambda v: (
            isinstance(v, dict) and all(isinstance(k, str) and _is_ids(p) for k, p in v.items())
        ),
        "an object of page id lists",
    ),
    "num_tokens": (lambda v: _is_int(v, 1), "a positive integer"),
    "page_size": (lambda v: _is_int(v, 1, 1 << 16), "a positive integer"),
    "tp_size": (lambda v: _is_int(v, 1, 1 << 10), "a positive integer"),
    "kv_layout": (_is_str, "a string"),
    "dtype": (_is_str, "a string"),
    "model_fingerprint": (_is_str, "a string"),
    "lease_ttl_s": (lambda v: _is_logprob(v) and v > 0, "a positive number"),
    "first_token_logprobs": (_is_first_logprobs, "null or [logprob, [[id, logprob], ...]]"),
    "first_token_ids": (
        lambda v: v is None or (_is_ids(v) and 1 <= len(v) <= MAX_N),
        f"null or a list of 1..{MAX_N} token ids",
    ),
    "first_tokens_logprobs": (
        lambda v: (
            v is None
            or (isinstance(v, list) and len(v) <= MAX_N and all(map(_is_first_logprobs, v)))
        ),
        "null or a list of first_token_logprobs",
    ),
    "cached_tokens": (_is_int, "a non-negative integer"),
    "prompt_logprobs": (
        _is_prompt_logprobs,
        "null or [[logprob, rank, [[id, logprob], ...]], ...]",
    ),
    "output_token_ids": (
        lambda v: v is None or _is_ids(v),
        f"null or a list of token ids (0..{MAX_TOKEN_ID})",
    ),
    "do_remote_prefill": (lambda v: isinstance(v, bool), "a boolean"),
    "pd_version": (lambda v: v == PD_VERSION, f"{PD_VERSION}"),
}


def _clip(value: Any, limit: int = 60) -> str:
    """A short, cheap description of a bad value (it may be megabytes of a client's JSON)."""
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + "..."
    return repr(value)
