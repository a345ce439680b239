"""`pd-bench sampling` runs and reports every case (a tiny vocabulary keeps it fast)."""

import argparse

from pd.bench import sampling


def test_pd_bench_sampling_reports_every_case(capsys):
    args = argparse.Namespace(rows=4, vocab=300, repeats=2, threads=1, json=True)
    assert sampling.run(args) == 0
    out = capsys.readouterr().out
    for name in sampling.CASES:
        assert f'"{name}"' in out
