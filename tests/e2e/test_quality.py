"""`pd-bench quality` against a real fp32 worker in process, with itself as the reference:
greedy answers agree 32 of 32, perplexity and multiple choice are read from echo + logprobs."""

from __future__ import annotations

import pytest

from pd.bench.quality import AGREEMENT_TOKENS, format_report, measure

pytestmark = pytest.mark.slow  # loads the real model


async def test_a_small_run_against_a_real_worker(client):
    url = str(client.make_url("")).rstrip("/")
    report = await measure(url, url, None, n_prompts=3, n_items=8, tokens=8)
    assert report.agreement_solo == AGREEMENT_TOKENS  # greedy is reproducible (8 of 8: whole)
    assert report.agreement is not None and report.self_agreement is not None
    assert report.perplexity is not None and 1.0 < report.perplexity < 100
    assert report.mc_items == 8 and report.mc_accuracy is not None and not report.missing
    assert "multiple choice" in format_report(report)
