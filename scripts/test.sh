#!/usr/bin/env bash
# Install everything the tests need, then run them all.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec "${PYTHON:-python3}" -m pytest -q "$@"
