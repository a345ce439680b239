"""Where inductor keeps what it compiled: under pd's cache directory, in a folder per CPU as
capped (`scripts/as_avx2.sh`). Every pd compile (`--compile`, the background one-row step) goes
through `use_pd_inductor_cache` first."""

from __future__ import annotations

import hashlib
import os

import torch

from pd.worker.model.tuning import kernel_cache
from pd.worker.model.tuning.cpu_info import CpuInfo, read_cpu_info


def use_pd_inductor_cache() -> str:
    """Point inductor's cache under pd's cache directory (unless the user pointed it), in a
    folder of this CPU's own (`inductor_cache_name`). Importing inductor writes its default
    folder into the environment: that one counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # imports inductor

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        path = kernel_cache.cache_root() / "inductor" / inductor_cache_name(read_cpu_info())
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def inductor_cache_name(cpu: CpuInfo) -> str:
    """A folder name for inductor's cache on this CPU as capped (its model, flags and ISA
    limits, torch's version): inductor's own keys leave the caps out, and a graph compiled
    under `scripts/as_avx2.sh` and served on the uncapped CPU corrupted the heap at its first
    call ("corrupted size vs. prev_size", a float32 int4 one-row step on an AMD EPYC)."""
    key = repr((cpu.model, sorted(cpu.flags), cpu.limits, torch.__version__))
    return f"{cpu.kind.lower()}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
