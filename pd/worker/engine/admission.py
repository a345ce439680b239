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

    def max_tokens_for(self, prompt_len: int, asked: int | None, n: int = 1) -> int:
        """The request's generation budget per choice (`asked`, or up to the context when None);
        raises a 400 when the prompt, or prompt + `asked`, exceeds the context, or its `n`
        choices could never fit in the KV cache together: the prompt's full pages once (the
        choices share them), and each choice's partial last prompt page and its tokens."""
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
            asked = room
        elif asked > room:
            raise APIError(
                400,
                f"this model's context length is {self.max_model_len} tokens, but "
                f"{prompt_len + asked} were asked for ({prompt_len} in the prompt, {asked} "
                "in the completion): lower max_tokens or shorten the prompt",
                code="context_length_exceeded",
                param="max_tokens",
            )
        shared, tail = divmod(prompt_len, self.page_size)
        pages = shared + n * -(-(tail + asked) // self.page_size)
        if pages > self.num_pages:
            what = f"prompt + max_tokens ({prompt_len + asked} tokens)"
            if n > 1:
                what = f"the prompt and {n} choices of max_tokens {asked} ({pages} pages)"
            raise APIError(
                400,
                f"{what} exceed this worker's KV cache ({self.num_pages * self.page_size} tokens)",
                code="context_length_exceeded",
                param=None if n == 1 else "n",
            )
        return asked
