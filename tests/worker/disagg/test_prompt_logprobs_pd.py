"""The prompt's logprobs in PD, in one process (real engines, fake transfer backend, a stand-in
model): P computes them as it prefills and carries them in kv_transfer_params; D answers them;
D refuses params that lack them (400, nothing held); every page comes back on both sides."""

from __future__ import annotations

import pytest

from pd.protocol import APIError, GenerationOptions
from pd.worker.model import SampleOutput
from tests.admit import add_remote
from tests.worker.disagg.test_lifecycle import (
    PROMPT,
    Runner,
    drain,
    make_pair,  # noqa: F401 (a fixture)
    until,
)


class PromptRunner(Runner):
    """Samples token 7 and gives position p of a prompt the logprob -(p + 1), rank p + 1."""

    def execute(self, batch) -> SampleOutput:
        out = super().execute(batch)
        for i, (seq, cached, n) in enumerate(zip(batch.seqs, batch.num_cached, batch.num_new)):
            end = min(cached + n, len(seq.prompt_ids) - 1)
            if seq.params.prompt_logprobs is not None and end > cached:
                entries = [(-(p + 1.0), p + 1, [(3, -0.5)]) for p in range(cached, end)]
                out.prompt_logprobs.append((i, cached, entries))
        return out


OPTIONS = GenerationOptions(max_tokens=3, prompt_logprobs=1)


async def test_p_carries_the_prompt_logprobs_to_d_which_answers_them(make_pair):
    pair = await make_pair()
    pair.p.runner = PromptRunner(32)
    h = add_remote(pair.p, pair.prefill, PROMPT, GenerationOptions(max_tokens=1, prompt_logprobs=1))
    delta = await h.queue.get()
    assert delta.error is None and h.kv_transfer_params is not None
    pair.p.abort(h)
    want = [[-(p + 1.0), p + 1, [[3, -0.5]]] for p in range(len(PROMPT) - 1)]  # as JSON
    assert h.kv_transfer_params["prompt_logprobs"] == want
    kvp = pair.decode.validate(h.kv_transfer_params)
    d = await pair.decode.admit(kvp, OPTIONS)
    assert d.seq.prompt_logprobs == [(lp, rank, [(3, -0.5)]) for lp, rank, _ in want]
    tokens, error = await drain(d)
    assert error is None and tokens == [7, 7, 7]
    pair.d.abort(d)
    await until(lambda: pair.prefill.released.get("done") == 1, 2, "P told done")
    await pair.assert_settled()


@pytest.mark.parametrize("carried", [None, "short"])
async def test_d_refuses_params_without_them_and_holds_nothing(make_pair, carried):
    pair = await make_pair()
    params = await pair.prefilled()  # a request that did not ask: no prompt_logprobs
    assert params["prompt_logprobs"] is None
    if carried == "short":
        params["prompt_logprobs"] = [[-1.0, 1, []]]
    with pytest.raises(APIError) as e:
        await pair.decode.admit(pair.decode.validate(params), OPTIONS)
    assert e.value.status == 400 and e.value.param == "kv_transfer_params"
    assert not pair.d.handles
    pair.prefill.release(params["transfer_id"], "refused by D")
    await pair.assert_settled()
