"""Several choices in one answer: `n` > 1 (a handle and its forks) and lists of prompts (one
handle per prompt). Choice `prompt_index * n + choice_index` (vLLM's order) is one
`ResponseBuilder`; usage counts each prompt once and the completion tokens of every choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from pd.worker.api.openai_format import ResponseBuilder
from pd.worker.engine import Delta, RequestHandle


def choices_of(handles: list[RequestHandle]) -> list[RequestHandle]:
    """Every choice's handle, in index order: per prompt, its handle then its forks."""
    return [c for h in handles for c in (h, *h.forks)]


def usage(prompts: list[ResponseBuilder], builders: list[ResponseBuilder]) -> dict[str, Any]:
    """`prompts`: one builder per prompt (its prompt counted once); `builders`: every choice."""
    prompt_tokens = sum(b.prompt_tokens for b in prompts)
    completion = sum(b.completion_tokens for b in builders)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": sum(b.cached_tokens() for b in prompts)},
    }


async def collect(
    choices: list[RequestHandle],
    builders: list[ResponseBuilder],
    ready: Callable[[ResponseBuilder], Awaitable[None]],
) -> None:
    """Wait for every choice's last delta (raises the first error); `ready(builder)` runs
    before each delta is added (it builds the prompt's part once the first comes)."""
    for handle, builder in zip(choices, builders):
        while builder.finish_reason is None:
            delta = await handle.queue.get()
            if delta.error is not None:
                raise delta.error
            await ready(builder)
            builder.add(delta)


async def interleave(
    choices: list[RequestHandle], builders: list[ResponseBuilder]
) -> AsyncIterator[tuple[ResponseBuilder, Delta]]:
    """Every choice's deltas as they come, until each has its last (an error delta ends it)."""
    if len(choices) == 1:  # the common case: no task
        while builders[0].finish_reason is None:
            delta = await choices[0].queue.get()
            yield builders[0], delta
            if delta.error is not None:
                return
        return
    merged: asyncio.Queue[tuple[ResponseBuilder, Delta]] = asyncio.Queue()

    async def pump(handle: RequestHandle, builder: ResponseBuilder) -> None:
        while True:
            delta = await handle.queue.get()
            await merged.put((builder, delta))
            if delta.finish_reason is not None or delta.error is not None:
                return

    tasks = [asyncio.create_task(pump(h, b)) for h, b in zip(choices, builders)]
    try:
        left = len(choices)
        while left:
            builder, delta = await merged.get()
            yield builder, delta
            if delta.error is not None:
                return
            if delta.finish_reason is not None:
                left -= 1
    finally:
        for t in tasks:
            t.cancel()
