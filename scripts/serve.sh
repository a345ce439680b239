#!/usr/bin/env bash
# Install, then serve the default model on http://127.0.0.1:${PORT:-8000} (OpenAI API).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec pd-worker --role both --host 127.0.0.1 --port "${PORT:-8000}" "$@"
