"""`pd-bench quality --url URL [--reference URL]`: how faithful any OpenAI-compatible server's
answers are (issue 40, item 5), from three measures:

- **greedy agreement** with a reference server (e.g. a `--dtype float32 --quantization none`
  worker): on the shipped prompts (`pd/worker/model/data/quality_prompts.json`: 64, chat and
  completion, README's among them), the mean number of leading tokens, of the first 32, equal to
  the reference's. Each server answers them one at a time and all at once; the worse of the two
  counts. Tokens are compared as the logprobs name them (their text), so any server can be read.
  Without a reference, the server's batched answers are compared with its own solo ones (how
  much its answers move with load);
- **perplexity** on shipped text (`data/perplexity.txt`), by `echo` + `logprobs`, one prompt a
  request with `max_tokens` 1 and only the prompt's tokens kept, as lm-eval's `gguf` backend asks
  (llama-cpp-python's server refuses a list of prompts with `echo` and reads `max_tokens` 0 as
  "until the context ends");
- **multiple-choice accuracy** by log-likelihood on 200 items the project wrote
  (`data/quality_mc.json`, CC0-1.0: capitals, opposites, sequences, colours, animals, plurals,
  sums), each choice scored as lm-eval scores it: the sum of the logprobs of its tokens after
  "Question: ...\\nAnswer:" (one request per choice).

It prints a table (and `--json`). `--prompts` and `--items` take the first N of each set
(small runs, tests). A measure the server does not support (no `echo`) is reported as missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

import aiohttp

AGREEMENT_TOKENS = 32


def shipped(name: str) -> Any:
    text = resources.files("pd.worker.model").joinpath(f"data/{name}").read_text()
    return json.loads(text) if name.endswith(".json") else text


def leading_equal(a: list[str], b: list[str], first: int = AGREEMENT_TOKENS) -> int:
    """How many leading tokens of the first `first` are equal (an answer that ended earlier in
    both counts as equal up to its end)."""
    n = 0
    for x, y in zip(a[:first], b[:first], strict=False):
        if x != y:
            return n
        n += 1
    return first if len(a[:first]) == len(b[:first]) else n


def continuation_logprob(
    text_offsets: list[int], logprobs: list[float | None], start: int
) -> float:
    """Sum of the logprobs of the tokens that begin at or after character `start` (the choice's
    tokens when the prompt is context + choice)."""
    return sum(
        lp
        for off, lp in zip(text_offsets, logprobs, strict=True)
        if off >= start and lp is not None
    )


def prompt_part(logprobs: dict[str, Any], prompt_chars: int) -> dict[str, list[Any]]:
    """The echoed prompt's tokens of a `logprobs` object (those beginning before character
    `prompt_chars`), without what the server generated after it."""
    keep = [i for i, off in enumerate(logprobs["text_offset"]) if off < prompt_chars]
    return {k: [logprobs[k][i] for i in keep] for k in ("tokens", "token_logprobs", "text_offset")}


def perplexity(logprobs: list[float | None]) -> float:
    """exp(mean NLL) over the tokens after the first (whose logprob is null)."""
    vals = [lp for lp in logprobs[1:] if lp is not None]
    return math.exp(-sum(vals) / len(vals))


@dataclass
class Report:
    url: str
    model: str
    prompts: int = 0
    agreement_solo: float | None = None  # vs the reference (or None without one)
    agreement_batched: float | None = None
    agreement: float | None = None  # the worse of the two
    self_agreement: float | None = None  # batched vs solo on this server
    identical_solo_batched: int | None = None  # prompts whose 32 tokens are equal both ways
    perplexity: float | None = None
    mc_items: int = 0
    mc_accuracy: float | None = None
    mc_by_kind: dict[str, float] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)


class Client:
    def __init__(
        self, http: aiohttp.ClientSession, url: str, model: str | None, tokens: int
    ) -> None:
        self.http = http
        self.url = url.rstrip("/")
        self.model = model
        self.tokens = tokens  # of each greedy answer

    async def resolve_model(self) -> str:
        if self.model is None:
            async with self.http.get(self.url + "/v1/models") as resp:
                self.model = (await resp.json())["data"][0]["id"]
        return self.model

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.post(self.url + path, json={"model": self.model, **body}) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{path}: {resp.status} {data}")
            return data

    async def greedy_tokens(self, prompt: dict[str, Any]) -> list[str]:
        """The first `tokens` tokens of a greedy answer, as the logprobs name them."""
        common = {"max_tokens": self.tokens, "temperature": 0}
        if prompt["kind"] == "chat":
            # top_logprobs 1: llama-cpp-python's server sends no logprobs without it
            data = await self.post("/v1/chat/completions",
                                   {**common, "messages": prompt["messages"], "logprobs": True,
                                    "top_logprobs": 1})  # fmt: skip
            content = data["choices"][0]["logprobs"]["content"] or []
            return [t["token"] for t in content]
        data = await self.post(
            "/v1/completions", {**common, "prompt": prompt["prompt"], "logprobs": 0}
        )
        return list(data["choices"][0]["logprobs"]["tokens"])

    async def answers(self, prompts: list[dict[str, Any]], at_once: bool) -> list[list[str]]:
        if at_once:
            return list(await asyncio.gather(*(self.greedy_tokens(p) for p in prompts)))
        return [await self.greedy_tokens(p) for p in prompts]

    async def echo_logprobs(self, prompt: str) -> dict[str, list[Any]]:
        """The prompt's tokens scored (lm-eval's log-likelihood request, in the one-prompt,
        one-token form every server here takes): the generated token is dropped, by its text
        offset (at or after the prompt's end)."""
        data = await self.post("/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                   "echo": True, "logprobs": 0, "temperature": 0})  # fmt: skip
        return prompt_part(data["choices"][0]["logprobs"], len(prompt))

    async def mc_choice(self, item: dict[str, Any]) -> int:
        context = f"Question: {item['question']}\nAnswer:"
        scored = [await self.echo_logprobs(f"{context} {c}") for c in item["choices"]]
        sums = [
            continuation_logprob(lp["text_offset"], lp["token_logprobs"], len(context))
            for lp in scored
        ]
        return max(range(len(sums)), key=sums.__getitem__)


async def measure(
    url: str,
    reference: str | None,
    model: str | None,
    n_prompts: int,
    n_items: int,
    tokens: int = AGREEMENT_TOKENS,
) -> Report:
    prompts = shipped("quality_prompts.json")["prompts"][:n_prompts]
    items = shipped("quality_mc.json")["items"][:n_items]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        client = Client(http, url, model, tokens)
        report = Report(url, await client.resolve_model(), prompts=len(prompts))
        solo = await client.answers(prompts, at_once=False)
        batched = await client.answers(prompts, at_once=True)
        pairs = list(zip(solo, batched, strict=True))
        report.self_agreement = _mean(leading_equal(a, b) for a, b in pairs)
        report.identical_solo_batched = sum(
            a[:AGREEMENT_TOKENS] == b[:AGREEMENT_TOKENS] for a, b in pairs
        )
        if reference is not None:
            ref = await Client(http, reference, model, tokens).answers(prompts, at_once=False)
            report.agreement_solo = _mean(
                leading_equal(a, r) for a, r in zip(solo, ref, strict=True)
            )
            report.agreement_batched = _mean(
                leading_equal(b, r) for b, r in zip(batched, ref, strict=True)
            )
            report.agreement = min(report.agreement_solo, report.agreement_batched)
        try:
            lp = await client.echo_logprobs(shipped("perplexity.txt"))
            report.perplexity = perplexity(lp["token_logprobs"])
            right: dict[str, list[bool]] = {}
            for item in items:
                ok = await client.mc_choice(item) == item["answer"]
                right.setdefault(item["kind"], []).append(ok)
            every = [ok for oks in right.values() for ok in oks]
            report.mc_items = len(every)
            report.mc_accuracy = _mean(every) if every else None
            report.mc_by_kind = {k: _mean(v) for k, v in sorted(right.items())}
        except (RuntimeError, KeyError, TypeError) as e:  # no echo + logprobs on this server
            report.missing.append(f"perplexity and multiple choice: {e}")
    return report


def _mean(values: Any) -> float:
    vals = [float(v) for v in values]
    return sum(vals) / len(vals)


def format_report(r: Report) -> str:
    def f(v: float | None, digits: int = 2) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    lines = [
        f"pd-bench quality: {r.url} ({r.model}), {r.prompts} prompts, {r.mc_items} items",
        f"  greedy agreement with the reference (leading tokens of {AGREEMENT_TOKENS}): solo "
        f"{f(r.agreement_solo)}, all at once {f(r.agreement_batched)}, counted {f(r.agreement)}",
        f"  the same server alone vs all at once: {f(r.self_agreement)} leading tokens, "
        f"{r.identical_solo_batched}/{r.prompts} answers identical",
        f"  perplexity on the shipped text: {f(r.perplexity, 3)}",
        f"  multiple choice (chance 0.25): {f(r.mc_accuracy, 3)}  "
        + "  ".join(f"{k} {v:.2f}" for k, v in r.mc_by_kind.items()),
    ]
    lines += [f"  missing: {m}" for m in r.missing]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server to judge (OpenAI-compatible)")
    p.add_argument("--reference", help="the server whose greedy answers are the reference")
    p.add_argument("--model", help="the model name to send (default: the server's first)")
    p.add_argument("--prompts", type=int, default=64, help="the first N shipped prompts")
    p.add_argument("--items", type=int, default=200, help="the first N multiple-choice items")
    p.add_argument(
        "--tokens", type=int, default=AGREEMENT_TOKENS, help="tokens of each greedy answer"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(
        measure(args.url, args.reference, args.model, args.prompts, args.items, args.tokens)
    )
    print(json.dumps(asdict(report), indent=1) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
