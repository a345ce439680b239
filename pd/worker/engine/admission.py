"""Whether a request fits this worker: the one place that checks the context length and the KV
budget, and resolves how many tokens the request may generate."""

from __future__ import annotations

from dataclasses import dataclass

from pd.protocol import APIError


@dataclass(frozen=True)
class Capacity:
    max_model_len: int  # context length in tokens
    page_size: int
    num_pages: int  # KV pages per rank

    def max_tokens_for(self, prompt_len: int, asked: int | None) -> int:
        """The request's generation budget (`asked`, or up to the context when None); raises a
        400 when the prompt, or prompt + `asked`, exceeds the context or the whole KV cache."""
        if prompt_len >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens but this model's context length is "
                f"{self.max_model_len}: shorten it",
                code="context_length_exceeded",
                param="messages",
            )
        room = self.max_model_len - prompt_len
        if asked is None:
            max_tokens = room
        elif asked > room:
            raise APIError(
                400,
                f"this model's context length is {self.max_model_len} tokens, but "
                f"{prompt_len + asked} were asked for ({prompt_len} in the prompt, {asked} "
                "in the completion): lower max_tokens or shorten the prompt",
                code="context_length_exceeded",
                param="max_tokens",
            )
        else:
            max_tokens = asked
        if -(-(prompt_len + max_tokens) // self.page_size) > self.num_pages:
            raise APIError(
                400,
                f"prompt + max_tokens ({prompt_len + max_tokens} tokens) exceed this worker's "
                f"KV cache ({self.num_pages * self.page_size} tokens)",
                code="context_length_exceeded",
            )
        return max_tokens
