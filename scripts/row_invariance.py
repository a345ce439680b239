"""Where each (dtype, weight format) this machine's torch runs computes a row otherwise in a batch
than alone, on the default model's shapes (pd/worker/model/tuning/row_invariance.py):
    python scripts/row_invariance.py [--threads N] [--largest ROWS] [--head-rows ROWS]
    scripts/as_avx2.sh python scripts/row_invariance.py   # an AVX2 machine's kernels
"""

from __future__ import annotations

import argparse
import time

import torch

from pd.worker.checkpoint.loader import load_checkpoint
from pd.worker.model.tuning.kernel_search import formats_here
from pd.worker.model.tuning.row_invariance import batch_rows, head_differs, layers_differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--largest", type=int, default=512, help="the largest batch of the layers")
    ap.add_argument("--head-rows", type=int, default=64, help="the largest batch of the head")
    ap.add_argument("--model", default=None, help="a .gguf (default: the embedded model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from pd.worker.checkpoint.default_model import default_model_path

        args.model = default_model_path()
    config = load_checkpoint(args.model).config
    rows = batch_rows(args.largest, (args.largest,))
    head_rows = batch_rows(args.head_rows, (args.head_rows,))
    print(f"threads {args.threads}; layers at {rows} rows, LM head at {head_rows}")
    for dtype in ("float32", "bfloat16"):
        for q in formats_here(config, 1, 32):
            t = time.perf_counter()
            layers = layers_differ(dtype, q, config, 1, 32, rows)
            head = head_differs(dtype, q, config, 32, head_rows)
            print(
                f"{dtype}/{q}: layers {layers or 'the same'}; LM head {head or 'the same'}"
                f" ({time.perf_counter() - t:.1f} s)"
            )


if __name__ == "__main__":
    main()
