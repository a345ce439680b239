#!/usr/bin/env bash
# Install, then serve the default model disaggregated: a prefill worker and a decode worker
# (KV pulled over NIXL) behind pd-router on http://127.0.0.1:${PORT:-8000} (OpenAI API).
#   bash scripts/serve.sh                 # router + prefill + decode
#   PD_MODE=both bash scripts/serve.sh    # one co-located worker instead
# Extra arguments go to both workers (e.g. --dtype float32; a --threads N there wins).
# P and D split the machine's cores (PD_THREADS=N gives each N): torch threads of two workers
# that each take every core fight, and decode steps were measured up to 10x slower.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT=${PORT:-8000}
HOST=127.0.0.1

if [ "${PD_MODE:-pd}" = "both" ]; then
  exec pd-worker --role both --host "$HOST" --port "$PORT" "$@"
fi

# P and D prove to each other that they share this secret (it never crosses the wire); P signs
# its kv_transfer_params and the router its continuations with it.
export PD_CLUSTER_TOKEN=${PD_CLUSTER_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}
CORES=$(nproc 2>/dev/null || echo 2)
THREADS=${PD_THREADS:-$(( CORES > 1 ? CORES / 2 : 1 ))}
P_PORT=$((PORT + 1))
D_PORT=$((PORT + 2))
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

pd-worker --role prefill --host "$HOST" --port "$P_PORT" --threads "$THREADS" "$@" &
pids+=($!)
pd-worker --role decode --host "$HOST" --port "$D_PORT" --threads "$THREADS" "$@" &
pids+=($!)
for port in "$P_PORT" "$D_PORT"; do
  until python3 -c "import urllib.request as u; u.urlopen('http://$HOST:$port/health', timeout=1)" 2>/dev/null; do
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "a worker exited" >&2; exit 1; }; done
    sleep 1
  done
done
pd-router --host "$HOST" --port "$PORT" --prefill "http://$HOST:$P_PORT" --decode "http://$HOST:$D_PORT" &
pids+=($!)
until python3 -c "import urllib.request as u; u.urlopen('http://$HOST:$PORT/health', timeout=1)" 2>/dev/null; do
  sleep 0.5
done
echo "pd ready: router http://$HOST:$PORT -> prefill :$P_PORT, decode :$D_PORT ($THREADS threads each)"
wait -n "${pids[@]}"
