"""Workers with quantized weights answer right: int4 (the GGUF's Q4_1 blocks packed as they are),
int8, oneDNN's bf16 kernel and smooth-int8 (calibrated at load), each a real `pd-worker --role
both` process, greedy."""

from __future__ import annotations

import aiohttp
import pytest
import torch

from tests.e2e.processes import start_worker, stop

pytestmark = pytest.mark.slow


# Not fbgemm-int8 / onednn-int8: their activations quantized per tensor lose too much on this
# model (perplexity 1.7x and 2.9x fp32's, test_quant.py; "La France, la France..." here), which
# is why `auto` rejects them; smooth-int8 is the same kernel made to keep it (smooth_quant.py).
@pytest.mark.parametrize("quantization", ["int4", "int8", "onednn-bf16", "smooth-int8"])
async def test_a_quantized_worker_gives_the_right_greedy_answer(quantization):
    from pd.worker.model.kernels import onednn_bf16_refusal

    if quantization == "onednn-bf16" and onednn_bf16_refusal():
        pytest.skip(f"no oneDNN bf16 linear on this CPU: {onednn_bf16_refusal()}")
    if quantization == "smooth-int8" and "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch on this machine has no FBGEMM quantized engine")
    # onednn-bf16 in an fp32 model: with bf16 activations between the layers too its first
    # token flips at a near tie ("The" over "L'" by 0.08 logits in fp32; perplexity x1.007).
    dtype = ("--dtype", "float32") if quantization in ("onednn-bf16", "smooth-int8") else ()
    proc, url = start_worker(
        "--role", "both", "--quantization", quantization, "--threads", "1", "--kv-pages", "64",
        *dtype,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/health") as resp:
                health = await resp.json()
            assert health["quantization"] == quantization
            # Not "the capital of France": its first token is a near tie in this model ("The"
            # against "L", -1.88 and -1.96 in fp32), an exact one with bf16 int4 on an AMD
            # EPYC (Zen 4) and "Paris" on an Intel Xeon: the CPU's rounding picks the answer.
            # Japan's first token leads by 2.5 logprobs (fp32, and bf16 int4 there).
            body = {
                "messages": [{"role": "user", "content": "What is the capital of Japan?"}],
                "max_tokens": 16,
                "temperature": 0,
            }
            async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            assert "Tokyo" in answer["choices"][0]["message"]["content"]
    finally:
        stop(proc)
