"""The answer judge (pd/worker/model/tuning/answer_judge.py) on configurations named on the
command line, in process, as the kernel search asks it: each one's mean leading tokens (of 32)
equal to fp32's greedy answers on the 64 shipped prompts, alone and packed, and the bar (bf16
without quantization, less one prompt's worth).

    python scripts/judge_answers.py float32/int4 float32/int4:onednn-fp32 float32/int4-fp32

`DTYPE/FORMAT[:HEAD]`: the layers' dtype and format, and the LM head's format (default: the
layers' rule). `--threads N` (default 2). Under `scripts/as_avx2.sh` for the AVX2 kind's kernels.
"""

from __future__ import annotations

import argparse

import torch

from pd.worker.checkpoint import default_model_path
from pd.worker.checkpoint.loader import load_checkpoint
from pd.worker.model.tuning.answer_judge import AnswerJudge, prompt_ids
from pd.worker.model.tuning.autotune import Candidate
from pd.worker.model.tuning.kernel_search import PerplexityJudge
from pd.worker.model.tuning.perplexity import shipped_text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+", help="DTYPE/FORMAT[:HEAD]")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(default_model_path(), torch.float32, progress=False, keep_q4_1=True)
    tok = ckpt.tokenizer
    perplexity = PerplexityJudge(
        ckpt.config, ckpt.weights, tok.encode(shipped_text()), 1, 32, tok.encode
    )
    judge = AnswerJudge(
        prompt_ids(tok.encode, tok.apply_chat_template),
        perplexity,
        args.chunk_size,
        lambda c: False,  # judged alone and packed, both
    )
    print(f"bar {judge.bar():.2f} (bf16-none less one prompt's worth)", flush=True)
    for spec in args.configs:
        layers, _, head = spec.partition(":")
        a = judge.agreement(Candidate.parse(layers), head or "auto")
        verdict = "passes" if a.counted >= judge.bar() else "refused"
        print(f"{spec}: alone {a.alone:.2f}, packed {a.together:.2f}: {verdict}", flush=True)


if __name__ == "__main__":
    main()
