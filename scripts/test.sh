#!/usr/bin/env bash
# Install everything the tests need, type-check pd, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
"${PYTHON:-python3}" -m mypy  # the type check: [tool.mypy] in pyproject.toml
# Two test processes (pytest-xdist), each file's tests in one of them (`loadfile`: a module's
# fixtures start its workers once): most of an end-to-end test's time is waiting (for a model to
# load, a heartbeat, a deadline), which the other process fills. PD_TEST_PROCESSES=0: all in one.
exec "${PYTHON:-python3}" -m pytest -q -n "${PD_TEST_PROCESSES:-2}" --dist loadfile \
  --durations=30 "$@"  # the slowest, to budget CI time
