"""Mooncake-style traces: parsing, equal hash_ids as equal prefixes, timestamps honoured."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd.bench.serve.trace import TraceError, parse_trace, read_trace, trace_jobs

TRACE = str(Path(__file__).parent / "data" / "mini_trace.jsonl")


def test_hash_ids_give_shared_prefixes_and_exact_lengths(token_text):
    entries = read_trace(TRACE)
    jobs = trace_jobs(entries, token_text)
    prompts = [j.turns[0].prompt for j in jobs]
    assert [token_text.count(p) for p in prompts] == [700, 600, 1100, 300]
    words = [p.split(" ")[1:] for p in prompts]  # one word = one token
    assert words[0] == words[2][:700]  # blocks 0 and 1 are shared
    assert words[0][:512] == words[1][:512]  # block 0 is shared
    assert words[0][512:600] != words[1][512:600]  # block 1 vs block 2
    assert words[3][:100] != words[0][:100]
    assert [j.at_s for j in jobs] == [0.0, 0.3, 0.5, 0.9]
    assert [j.turns[0].max_tokens for j in jobs] == [4, 3, 5, 2]
    assert [j.at_s for j in trace_jobs(entries, token_text, time_scale=2.0)][-1] == 1.8


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": "9", "output_length": 1}', "'input_length' must be"),
        ('{"timestamp": 0, "input_length": 9, "output_length": 0}', "lengths >= 1"),
        ('{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": "x"}', "hash_ids"),
    ],
)
def test_malformed_lines_name_the_line(line, needle):
    with pytest.raises(TraceError, match=needle) as e:
        parse_trace(['{"timestamp": 0, "input_length": 9, "output_length": 1}', line], "t.jsonl")
    assert str(e.value).startswith("t.jsonl:2:")
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["", "  "], "empty.jsonl")
