"""A traced request's spans on a worker, made once it ends from its `Timeline` (when it reached
each stage: pd/worker/engine/request.py), so the engine's loop never touches a span.

Under the worker's request span (a child of the router's call, from `traceparent`):

- prompt computed here (prefill, co-located, decode-local): `pd.queue` (arrival to its first
  step in the running batch), `pd.prefill` (to its first token); on a prefill worker answering
  for a decode worker, `pd.handoff` (the first token to the answer with its KV params);
- KV from elsewhere (decode): `pd.admission` (arrival to queued: parsed, checked, the receiver
  made), `pd.page_wait` (to its pages lent), `pd.kv_pull` (the transfer: bytes, seconds);
- `pd.decode` (the first token to the end: TTFT, ITL p50/p99, tokens), when it decoded."""

from __future__ import annotations

from pd.tracing import AttributeValue, Parent, Span, Tracing, epoch_ns
from pd.worker.engine import RequestHandle


def _quantile(sorted_gaps: list[float], q: float) -> float:
    return sorted_gaps[min(len(sorted_gaps) - 1, int(q * len(sorted_gaps)))]


def record_request(
    tracing: Tracing,
    parent: Parent | None,
    role: str,
    path: str,
    handles: list[tuple[RequestHandle, float]],
    t_arrive: float,
    t_end: float,
    error: str | None,
) -> None:
    """The spans of one HTTP request whose `handles` (each with when it was queued) ended at
    `t_end`; `error` says why it failed (None: answered)."""
    root = tracing.start(
        f"pd-worker POST {path}", parent, start_ns=epoch_ns(t_arrive), kind="server"
    )
    if not root.recording:
        return
    root.set("pd.role", role)
    for i, (handle, t_queued) in enumerate(handles):
        _stages(tracing, root, role, handle, i, t_arrive, t_queued, t_end)
    if error is not None:
        root.error(error)
    root.end(epoch_ns(t_end))


def _stages(
    tracing: Tracing,
    root: Span,
    role: str,
    handle: RequestHandle,
    index: int,
    t_arrive: float,
    t_queued: float,
    t_end: float,
) -> None:
    seq, times = handle.seq, handle.seq.times
    if times is None:
        return
    attrs: dict[str, AttributeValue] = {"pd.request_id": seq.request_id, "pd.prompt": index}
    root.set_many(
        {
            "pd.prompt_tokens": len(seq.prompt_ids),
            "pd.completion_tokens": len(seq.output_ids),
            "pd.cached_tokens": seq.num_cached_tokens or 0,
            "pd.finish_reason": seq.finish_reason or "abort",
            "pd.priority": seq.priority,
        }
    )

    def span(name: str, start: float | None, end: float | None, **more: float | int) -> None:
        if start is None:
            return
        s = tracing.start(name, root, start_ns=epoch_ns(start), attributes={**attrs, **more})
        s.end(epoch_ns(end if end is not None else t_end))

    first = seq.first_token_time
    lent = isinstance(handle.kv_transfer_params, dict)  # its KV goes on elsewhere: no decode here
    if times.pages is not None or times.kv_start is not None:  # KV from elsewhere
        span("pd.admission", t_arrive, t_queued)
        span("pd.page_wait", t_queued, times.pages)
        if times.kv_start is not None:
            seconds = (times.kv_end or t_end) - times.kv_start
            span("pd.kv_pull", times.kv_start, times.kv_end,
                 **{"pd.bytes": times.kv_bytes, "pd.seconds": seconds})  # fmt: skip
    elif times.scheduled is not None:  # computed here
        span("pd.queue", t_arrive, times.scheduled)
        span("pd.prefill", times.scheduled, first)
        if lent:
            span("pd.handoff", first, t_end)
    if first is not None and not lent:
        more: dict[str, float | int] = {
            "pd.ttft_s": first - t_arrive,
            "pd.tokens": len(seq.output_ids),
        }
        if times.gaps:
            gaps = sorted(times.gaps)
            more["pd.itl_p50_s"] = _quantile(gaps, 0.5)
            more["pd.itl_p99_s"] = _quantile(gaps, 0.99)
        span("pd.decode", first, seq.last_token_time or t_end, **more)
