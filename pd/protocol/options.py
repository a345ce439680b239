"""`GenerationOptions`, a request's sampling and stopping options, and the per-field checks and
bounds the parsers share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pd.protocol.constraints import Constraint, parse_constraint
from pd.protocol.errors import bad_request, clip


def optional(body: dict, name: str, types: type | tuple[type, ...], default: Any = None) -> Any:
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


def number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = float(optional(body, name, (int, float), default))
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return value


def integer(
    body: dict, name: str, default: int | None, lo: int, hi: int | None = None
) -> int | None:
    value = optional(body, name, int, default)
    if value is None:
        return None
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"'{name}' must be {bound}, got {value}", param=name)
    return value


# Token ids are int32 everywhere past the edge (torch, the router's index): larger ones are a 400
# here, before any vocabulary check.
MAX_TOKEN_ID = (1 << 31) - 1


def token_ids_field(value: Any, name: str) -> list[int]:
    if not is_token_ids(value):
        raise bad_request(
            f"'{name}' must be a list of token ids (integers in 0..{MAX_TOKEN_ID})", param=name
        )
    return value


# ---------------------------------------------------------------------------------- limits


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
# The longest text /tokenize counts: tokenizers holds the GIL for a time that grows with the
# text, and the event loop waits that long (docs/EXPERIMENTS.md §16, "Where the `/tokenize`
# time went"); 1 MiB is past any prompt of an 8k context
# (8192 tokens x 82 bytes a token at most, for SmolLM2).
MAX_TOKENIZE_CHARS = 1 << 20
MAX_CACHE_SALT_CHARS = 256
# Below this temperature sampling is greedy (as in vLLM): logits / temperature would overflow.
GREEDY_TEMPERATURE = 1e-5


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


def parse_options(
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
        value = integer(body, name, None, 0 if echo else 1)
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
    bounded(stop, "stop", MAX_STOP, "strings", MAX_STOP_CHARS)
    stop_token_ids = body.get("stop_token_ids")
    stop_token_ids = (
        tuple(token_ids_field(stop_token_ids, "stop_token_ids")) if stop_token_ids else ()
    )
    bounded(stop_token_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS, "token ids")
    bad_words = strings(body, "bad_words")
    bounded(bad_words, "bad_words", MAX_BAD_WORDS, "words", MAX_BAD_WORD_CHARS)
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        bounded(allowed, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, "token ids")
        allowed = tuple(token_ids_field(allowed, "allowed_token_ids"))
    best_of = integer(body, "best_of", 1, 1)
    if best_of != 1:
        raise bad_request("only best_of=1 is supported", param="best_of", code="unsupported_value")
    seed = optional(body, "seed", int)
    n: int = body["n"] if type(body.get("n")) is int else 1
    if seed is not None and not -(1 << 63) <= seed <= (1 << 63) - max(1, n):
        # Choice i samples with seed + i, in every request that carries it (migration legs).
        raise bad_request(
            "'seed' must be a signed 64-bit integer, and seed + n - 1 too", param="seed"
        )
    top_k = integer(body, "top_k", -1, -1)
    assert top_k is not None  # it has a default
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:  # OpenAI allows 0: the limit is "the most likely token only"
        temperature, top_p = 0.0, 1.0
    return GenerationOptions(
        constraint=parse_constraint(body),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_tokens=integer(body, "min_tokens", 0, 0) or 0,
        allowed_token_ids=allowed,
        bad_words=bad_words,
        include_stop_str_in_output=bool(optional(body, "include_stop_str_in_output", bool, False)),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if top_k == 0 else top_k,
        min_p=number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        seed=seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(optional(body, "ignore_eos", bool, False)),
        skip_special_tokens=bool(optional(body, "skip_special_tokens", bool, True)),
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
            raise bad_request(f"'logit_bias' key {clip(key)} is not a token id", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(
                f"'logit_bias' of token {token} must be a number in [-100, 100]", "logit_bias"
            )
        out.append((token, float(bias)))
    return tuple(out)


def bounded(values: Any, name: str, most: int, what: str, most_chars: int | None = None) -> None:
    """A 400 for a list longer than `most` (or, for strings, one longer than `most_chars`)."""
    if isinstance(values, (list, tuple)) and len(values) > most:
        raise bad_request(f"'{name}' may hold at most {most} {what}, got {len(values)}", param=name)
    if most_chars is not None and any(len(v) > most_chars for v in values):
        raise bad_request(
            f"each of '{name}' may be at most {most_chars} characters long", param=name
        )


def strings(body: dict, name: str) -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise bad_request(f"'{name}' must be a list of non-empty strings", param=name)
    return tuple(value)


# Structured-output fields (OpenAI's, vLLM's, SGLang's) -> the constraint kind each asks for.


def is_int(v: Any, lo: int = 0, hi: int = MAX_TOKEN_ID) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def is_token_ids(v: Any) -> bool:
    """A list of token ids (ints in 0..MAX_TOKEN_ID, no bools). A list of plain ints (as JSON
    gives) is checked in C (its types, its min and max: 3x faster at 4000 ids than an element
    at a time, on every prompt of ids and every KV hand-off)."""
    if not isinstance(v, list):
        return False
    if v and set(map(type, v)) == {int}:
        return 0 <= min(v) and max(v) <= MAX_TOKEN_ID
    return all(is_int(t) for t in v)
