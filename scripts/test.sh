#!/usr/bin/env bash
# Install everything the tests need, type-check pd, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
"${PYTHON:-python3}" -m mypy  # the type check: [tool.mypy] in pyproject.toml
exec "${PYTHON:-python3}" -m pytest -q --durations=30 "$@"  # the slowest, to budget CI time
