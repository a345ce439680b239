"""One client request on its way through the router (`Exchange`): the request's facts, parsed
once at the edge (`RequestFacts`, frozen), and the state of its relay (route, first token, the
stream's tracker, the workers not to try again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pd.tracing import NO_SPAN, Span

if TYPE_CHECKING:
    from pd.router.prefix_index import PromptKey
    from pd.router.tracker import Tracker
    from pd.router.worker import Worker


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the client asked, parsed once at the edge (app.py); the relay never changes them."""

    path: str  # the OpenAI path, the same on the workers
    body: dict[str, Any]  # the client's body, without kv_transfer_params (legs send copies)
    chat: bool
    stream: bool  # the client's stream flag
    include_usage: bool
    max_tokens: int | None  # the client's
    n: int  # choices
    seed: int | None
    prompt_logprobs: bool  # it asks for the prompt's logprobs (vLLM's, or echo with logprobs)
    key: str | None  # room key for sticky-to-room
    prompt: PromptKey  # the prompt as the prefix index sees it
    tokens: int  # estimated prompt tokens (P is charged those it lacks while it works)
    headers: dict[str, str]  # to send to workers


@dataclass(slots=True, eq=False)
class Exchange:
    """One client request on its way through the router: its facts, and its relay's state."""

    request: web.Request
    facts: RequestFacts
    t0: float
    route: str | None = None  # "local" when served decode-local (else the registry's route)
    ttft: float | None = None
    status: str | None = None  # overrides the response status in metrics ("stream_error")
    reads: int = 0  # chunks read from the upstream stream (for the idle watch)
    timed_out: bool = False  # the idle watch closed the upstream
    ejected: bool = False  # the worker streaming the answer was ejected meanwhile
    track: Tracker | None = None  # what was read of the stream being relayed (migrate.py)
    leg: bool = False  # a continuation leg of a migration: a break ends it, `broken` says why
    broken: str | None = None
    exclude: tuple[Worker, ...] = ()  # workers whose stream broke: not chosen again
    # Workers that disconnected before their first byte and then passed a health check: not
    # chosen again; a second one ends the request (`Proxy.retry`).
    disconnected: tuple[Worker, ...] = ()
    # A fan-out's sub-exchange (fanout.py): its stream goes here (prepare/write/write_eof), not
    # to the client.
    sink: Any = None
    # Most bytes of the answer the router assembles when the client does not stream (0: the
    # whole --max-answer-bytes; a list of prompts shares it out: answer_size.py)
    answer_limit: int = 0
    # Tracing (pd/tracing.py; NO_SPAN when off): the request's span (a migration leg's, for a
    # leg), and the W3C headers that make the workers' spans its children.
    span: Span = NO_SPAN
    trace_headers: dict[str, str] | None = None

    @property
    def upstream_headers(self) -> dict[str, str]:
        """The headers of a call to a worker: the request's, and the trace's when traced."""
        if self.trace_headers is None:
            return self.facts.headers
        return {**self.facts.headers, **self.trace_headers}
