#!/usr/bin/env bash
# Install everything the tests need, type-check pd, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
"${PYTHON:-python3}" -m mypy  # the type check: [tool.mypy] in pyproject.toml
# Two test processes (pytest-xdist): the end-to-end tests in one (tests/conftest.py groups
# them: their workers start once and two sets would not fit in memory), every other test in
# either; an end-to-end test spends most of its time waiting (a model load, a heartbeat, a
# deadline), which the other process fills. PD_TEST_PROCESSES=0: all in one.
exec "${PYTHON:-python3}" -m pytest -q -n "${PD_TEST_PROCESSES:-2}" --dist loadgroup \
  --durations=30 "$@"  # the slowest, to budget CI time
