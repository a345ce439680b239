"""Fixtures of the serve benchmark's tests: the embedded model's tokenizer, a stub server."""

from __future__ import annotations

import argparse

import pytest

from pd.bench.serve import add_arguments
from pd.bench.serve.text import TokenText
from pd.worker.checkpoint import default_model_path, load_tokenizer


@pytest.fixture(scope="session")
def token_text() -> TokenText:
    return TokenText(load_tokenizer(default_model_path()))


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))
