#!/usr/bin/env bash
# Run a command as if this CPU had AVX2 and nothing above it (no AVX-512, no AMX), as far as the
# kernels under torch go: each library's own cap on its instructions (pd/worker/model/tuning/cpu_info.py
# ISA_LIMITS). pd's CPU description, kernel choice and cache key follow the cap. Clocks, caches
# and memory stay this machine's: a stand-in for an AVX2 machine's kernels, not its speed.
#   scripts/as_avx2.sh pd-bench engine --configs all --compare-llama-cpp
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
    MKL_ENABLE_INSTRUCTIONS=AVX2
exec "$@"
