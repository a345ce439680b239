"""Fixtures for transfer tests (helpers live in transfer_helpers.py)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test modules import transfer_helpers
from transfer_helpers import PrefillProc  # noqa: E402


@pytest.fixture
def prefill_procs():
    """Factory of PrefillProc; every process is SIGKILLed at teardown."""
    procs: list[PrefillProc] = []

    def spawn(spec: dict, env: dict[str, str] | None = None) -> PrefillProc:
        p = PrefillProc(spec, env)
        procs.append(p)
        return p

    yield spawn
    for p in procs:
        p.kill(signal.SIGCONT)
        p.close()
