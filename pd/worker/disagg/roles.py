"""One entry point per role: `Role.admit` turns a parsed request into a queued `RequestHandle`, or
raises APIError (nothing is queued then). build.py picks the worker's role once; the HTTP handler
calls `admit` and never asks which role it serves, so its 4xx paths run on a stand-in role.

- `CoLocated` (`--role both`): prefills and decodes here; refuses `kv_transfer_params`.
- `Prefill`: a request the router marked for remote decode (`{"do_remote_decode": true}`) keeps
  its KV for a decode worker (`PrefillSide`, the engine's connector, takes its pages when its
  first token is out); a request without params is served as on a co-located worker.
- `Decode`: a request with P's params is validated and pulled (`DecodeSide`: D never
  re-tokenizes); one without is prefilled here (decode-local prefill, chosen by the router).

The prompt ids come as `prompt_ids`, awaited only on the paths that tokenize (the handler's
`PromptBuilder`: large prompts are tokenized off the event loop).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from pd.protocol import (
    MAX_TOP_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
)
from pd.protocol.names import PREFILLER_HEADER
from pd.worker.disagg.decode_side import DecodeSide
from pd.worker.disagg.prefill_side import PrefillSide
from pd.worker.disagg.prefiller import PrefillPeers, prefill_elsewhere
from pd.worker.engine import AdmitRequest, Engine, RequestHandle, every_choice
from pd.worker.text.token_rules import TokenRules

Request = CompletionRequest | ChatCompletionRequest
PromptIds = Callable[[], Awaitable[list[int]]]  # the request's prompt ids (tokenized when awaited)


ChoiceRules = list[TokenRules | None] | None  # n > 1: choices 1..n-1's rules (each its own)


Route = Callable[[dict[str, Any]], dict[str, Any]]  # a JSON body in, a JSON answer out


class Role(Protocol):
    name: str  # what /health and the load report
    takes_params: bool  # it consumes P's kv_transfer_params (a decode worker)

    def body_limit(self, prompt_limit: int, max_model_len: int) -> int:
        """The largest request body it reads, given a prompt's (`--max-body-bytes` unset)."""
        ...

    def routes(self) -> dict[str, Route]:
        """Its own POST routes, by path."""
        ...

    def unanswered(self, handle: RequestHandle, reason: str) -> None:
        """`handle`'s answer never left (the client left first): let go of what it kept."""
        ...

    async def body_for(self, path: str, headers: Mapping[str, str], raw: bytes) -> bytes:
        """The body to serve, after the role's part of an exchange a gateway asked for (decode:
        a prefill worker named by the endpoint picker, prefiller.py); `raw` otherwise."""
        ...

    async def run(self) -> None:
        """What the role does in the background while the worker serves, until cancelled
        (decode: watch its prefill peers, and close the session its prefill requests share);
        may return at once when there is nothing."""
        ...

    async def admit(
        self,
        req: Request,
        prompt_ids: PromptIds,
        rules: TokenRules | None = None,
        choice_rules: ChoiceRules = None,
    ) -> RequestHandle:
        """Queue `req` (with `rules` for its tokens: grammar, min_tokens, ...; with `n` > 1 its
        other choices in `handle.forks`); raises APIError when it is refused."""
        ...


class CoLocated:
    """Prefill and decode here: `--role both`, and what the other roles do for a request
    without `kv_transfer_params`."""

    name = "both"
    takes_params = False  # whether it consumes P's kv_transfer_params (signed: pd/signing.py)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def body_for(self, path: str, headers: Mapping[str, str], raw: bytes) -> bytes:
        if PREFILLER_HEADER in headers:
            raise bad_request(
                f"{PREFILLER_HEADER} is for decode workers; this one is {self.name}",
                PREFILLER_HEADER,
            )
        return raw

    async def run(self) -> None:
        return None

    def body_limit(self, prompt_limit: int, max_model_len: int) -> int:
        return prompt_limit

    def routes(self) -> dict[str, Route]:
        return {}

    def unanswered(self, handle: RequestHandle, reason: str) -> None:
        pass

    async def admit(
        self,
        req: Request,
        prompt_ids: PromptIds,
        rules: TokenRules | None = None,
        choice_rules: ChoiceRules = None,
    ) -> RequestHandle:
        if req.kv_transfer_params is not None:
            raise bad_request(
                f"this {self.name} worker does not take kv_transfer_params "
                f"{req.kv_transfer_params}",
                param="kv_transfer_params",
            )
        return self.engine.add(
            AdmitRequest(
                await prompt_ids(),
                req.options,
                req.cache_salt,
                every_choice(req.n, rules, choice_rules),
                req.continuation,
                priority=req.priority or 0,
            )
        )


class Prefill(CoLocated):
    name = "prefill"

    def __init__(self, engine: Engine, side: PrefillSide) -> None:
        super().__init__(engine)
        self.side = side

    def routes(self) -> dict[str, Route]:
        return {"/kv/release": self.kv_release}

    def kv_release(self, body: dict[str, Any]) -> dict[str, Any]:
        """Release the pages pinned for a transfer no decode worker will pull (the router calls
        it when D refused the params, no D was healthy, or the client left first)."""
        tid, reason = body.get("transfer_id"), body.get("reason", "released by the router")
        if not isinstance(tid, str) or not isinstance(reason, str):
            raise APIError(400, "expected {'transfer_id': str, 'reason': str}", param="transfer_id")
        return {"transfer_id": tid, "released": self.side.release(tid, reason[:200])}

    def unanswered(self, handle: RequestHandle, reason: str) -> None:
        """The pages pinned for a decode worker whose answer never left (the lease would hold
        them for --lease-ttl-s)."""
        params = handle.kv_transfer_params
        if isinstance(params, dict) and "transfer_id" in params:
            self.side.release(str(params["transfer_id"]), reason)

    async def admit(
        self,
        req: Request,
        prompt_ids: PromptIds,
        rules: TokenRules | None = None,
        choice_rules: ChoiceRules = None,
    ) -> RequestHandle:
        kvp = req.kv_transfer_params
        if kvp is None or kvp.get("do_remote_decode") is not True:
            return await super().admit(req, prompt_ids, rules, choice_rules)  # or a 400
        if req.stream:
            raise bad_request("a remote-decode prefill answers with stream=false", param="stream")
        # The client's max_tokens, which the router passes so that P refuses, before
        # prefilling, a request no decode worker could take.
        asked = kvp.get("max_tokens")
        if asked is not None and (
            not isinstance(asked, int) or isinstance(asked, bool) or asked < 1
        ):
            raise bad_request(
                "kv_transfer_params.max_tokens must be a positive integer",
                param="kv_transfer_params",
            )
        ids = await prompt_ids()
        self.engine.capacity.max_tokens_for(len(ids), asked, req.n)  # the whole request (D's)
        # P samples the first token: its rules constrain it as D's constrain the rest.
        # A continuation: prompt + its output ids prefilled, one token sampled past them.
        handle = self.engine.add(
            AdmitRequest(
                ids,
                req.options,
                req.cache_salt,
                every_choice(req.n, rules, choice_rules),
                req.continuation,
                budget_past_continuation=True,
                priority=req.priority or 0,
            )
        )
        self.side.expect(handle.seq)  # its pages go to a decode worker when its token is out
        return handle


class Decode(CoLocated):
    name = "decode"
    takes_params = True

    def __init__(
        self,
        side: DecodeSide,
        token: bytes | None = None,
        prefill_peers: PrefillPeers | None = None,
    ) -> None:
        super().__init__(side.engine)
        self.side = side
        self.token = token  # the cluster token, which the picker's header is signed with
        self.prefill_peers = prefill_peers or PrefillPeers()  # the P a gateway may name

    async def run(self) -> None:
        await self.prefill_peers.run()

    async def body_for(self, path: str, headers: Mapping[str, str], raw: bytes) -> bytes:
        return await prefill_elsewhere(
            self.name, self.token, self.prefill_peers, path, headers, raw
        )

    def body_limit(self, prompt_limit: int, max_model_len: int) -> int:
        # P's params may carry the prompt's logprobs: ~40 bytes an alternative, a position.
        return prompt_limit + max_model_len * (MAX_TOP_LOGPROBS + 2) * 40

    async def admit(
        self,
        req: Request,
        prompt_ids: PromptIds,
        rules: TokenRules | None = None,
        choice_rules: ChoiceRules = None,
    ) -> RequestHandle:
        if req.kv_transfer_params is None:  # decode-local prefill
            return await super().admit(req, prompt_ids, rules, choice_rules)
        kvp = self.side.validate(req.kv_transfer_params, req.n, req.continuation)
        # Its pages join this worker's prefix cache under the client's salt; its rules are
        # built from the same request as P's, and take P's first token before anything else.
        return await self.side.admit(
            kvp, req.options, req.cache_salt, rules, req.n, choice_rules, req.priority or 0
        )
