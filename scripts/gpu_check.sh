#!/usr/bin/env bash
# The CUDA checks in one command, for a machine with CUDA and maybe no network:
#   scripts/gpu_check.sh WHEELS_DIR
# installs what the GPU path needs from WHEELS_DIR only (never downloads: pip --no-index), then
# runs every CUDA check and prints a short report. Exit 0 when every check passed.
#   1. FlashInfer against torch attention (bf16): tests/worker/model/test_attention.py on CUDA
#   2. a worker on cuda whose attention is asserted to be FlashInfer (--attention-backend
#      flashinfer refuses to fall back), and
#   3. a prefill and a decode worker on the one GPU, NIXL moving the KV in VRAM, the router in
#      front: greedy text equal to a co-located CUDA worker's, as is a co-located worker's
#      with --cuda-graph-max-batch 8 (scripts/gpu_pd_check.py)
#   4. CUDA graphs against eager: captured decode graphs' logits and K/V, and a runner with
#      --cuda-graph-max-batch decoding greedily as one without (tests/worker/model/test_decode_graphs.py)
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:?usage: scripts/gpu_check.sh WHEELS_DIR (flashinfer-python, nixl-cu12, and the project dependencies)}"
PY="${PYTHON:-python3}"
REPORT=()
status=0

check() {  # check NAME COMMAND...: run it, record ok/FAIL with its last lines
    local name="$1"; shift
    local log; log="$(mktemp)"
    if "$@" >"$log" 2>&1; then REPORT+=("[ok]   $name"); else REPORT+=("[FAIL] $name"); status=1; fi
    tail -n 15 "$log" | sed "s/^/       /"
    rm -f "$log"
}

echo "== installing from $WHEELS (no index)"
"$PY" -m pip install -q --no-index --no-build-isolation --find-links "$WHEELS" -e ".[test]" flashinfer-python nixl-cu12 \
    || { echo "install from $WHEELS failed"; exit 2; }
"$PY" - <<'PYEOF' || { echo "no CUDA device visible to torch"; exit 2; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PYEOF

check "FlashInfer vs torch attention (bf16, CUDA)" \
    "$PY" -m pytest -q tests/worker/model/test_attention.py -k "flashinfer or cuda" -rs
check "PD on one GPU: FlashInfer asserted, NIXL in VRAM, greedy == co-located" \
    "$PY" scripts/gpu_pd_check.py
check "CUDA graphs vs eager (decode buckets, bf16)" \
    "$PY" -m pytest -q tests/worker/model/test_decode_graphs.py -rs -k "cuda"

echo
echo "== gpu_check report"
printf '%s\n' "${REPORT[@]}"
exit $status
