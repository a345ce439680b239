"""Tests' shorthand for the engine's admit request (pd/worker/engine/admit_request.py)."""

from pd.protocol import GenerationOptions
from pd.worker.engine import AdmitRequest
from pd.worker.text.token_rules import TokenRules


def admit(
    prompt_ids: list[int],
    options: GenerationOptions,
    *,
    n: int = 1,
    given: list[int] | None = None,
    rules: TokenRules | None = None,
    cache_salt: str | None = None,
    past_given: bool = False,
) -> AdmitRequest:
    """A request computed here: `n` choices (the first with `rules`), `given` a continuation's
    ids (`past_given`: max_tokens counts past them, as on a prefill worker)."""
    return AdmitRequest(
        prompt_ids, options, cache_salt, (rules,) + (None,) * (n - 1), given, past_given
    )


def add_remote(engine, side, prompt_ids, options, given=None, n=1):
    """What the prefill role does for a request a decode worker goes on with: queued here, its
    pages handed to `side` (a `PrefillSide`, the engine's connector) once its first token is
    out."""
    handle = engine.add(admit(prompt_ids, options, n=n, given=given, past_given=True))
    side.expect(handle.seq)
    return handle
