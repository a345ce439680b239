"""`AdmitRequest`: what a role hands the engine to queue one request (`Engine.add`), frozen.
Built by the roles (pd/worker/disagg/roles.py) from a parsed OpenAI request, or from another
worker's `kv_transfer_params`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pd.protocol import GenerationOptions
from pd.worker.text.token_rules import TokenRules


def every_choice(
    n: int, rules: TokenRules | None, others: Sequence[TokenRules | None] | None
) -> tuple[TokenRules | None, ...]:
    """One rules object per choice of `n`: `rules` for the first, `others` (none: no rules) for
    the rest."""
    return (rules, *(others or [None] * (n - 1)))


@dataclass(frozen=True)
class AdmitRequest:
    prompt_ids: Sequence[int]
    options: GenerationOptions
    cache_salt: str | None = None  # the client's: its pages are shared only with the same salt
    # One per choice (n = its length): what each choice's next token may be (grammar, ...)
    rules: tuple[TokenRules | None, ...] = (None,)
    # A continuation's output ids (docs/migration.md §3): another worker generated them
    continuation: Sequence[int] | None = None
    # max_tokens counts past the continuation's ids (else they are part of it)
    budget_past_continuation: bool = False
    # Its KV (the prompt's and the continuation's) comes from elsewhere (the connector's)
    kv_from_elsewhere: bool = False
    cached_tokens: int = 0  # with KV from elsewhere: the prompt tokens its source had cached
    priority: int = 0  # vLLM's: lower first (the scheduler's order of waiting requests)

    def __post_init__(self) -> None:
        if not self.rules:
            raise ValueError("a request has at least one choice")

    @property
    def n(self) -> int:
        return len(self.rules)
