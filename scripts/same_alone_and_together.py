"""How many of 16 greedy 64-token answers (`ignore_eos`) a co-located worker gives token for token
the same run one at a time and 8 at a time (issue 40, item 2), with the flags given:
    python scripts/same_alone_and_together.py [pd-worker flags...]
    python scripts/same_alone_and_together.py --dtype bfloat16 --quantization int4@1+onednn-bf16
The worker runs tests/e2e/test_default_kernels.py's flags (`--threads 1 --chunk-size 256 ...`)
and the kernel search (PD_KERNEL_SEARCH=1) with `$PD_CACHE_DIR` (default: a fresh directory)."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' helpers

from tests.e2e import test_default_kernels as t  # noqa: E402
from tests.e2e.processes import start_worker, stop  # noqa: E402


def main() -> None:
    flags = sys.argv[1:]
    cache = os.environ.get("PD_CACHE_DIR") or tempfile.mkdtemp(prefix="pd-cache-")
    env = {"PD_KERNEL_SEARCH": "1", "PD_CACHE_DIR": cache}
    proc, url = start_worker("--role", "both", *t.FLAGS, *flags, timeout=600, env=env)
    try:
        t0 = time.perf_counter()
        same = asyncio.run(t._alone_and_eight_at_a_time(url))
        print(f"{' '.join(flags) or 'default flags'}: {same} of {len(t.TOPICS)} the same alone "
              f"and 8 at a time ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
