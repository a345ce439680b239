"""The PD stack on one CUDA device, for scripts/gpu_check.sh: a co-located worker, a prefill and a
decode worker (bf16, FlashInfer asserted: `--attention-backend flashinfer` never falls back) with
NIXL moving the KV between them in VRAM, and pd-router in front. Greedy answers through the
router must equal the co-located worker's, and so must those of a co-located worker replaying
its decode steps from CUDA graphs (`--cuda-graph-max-batch 8`). Prints one line per check and exits non-zero on any
failure; stops every process it started.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.processes import start_worker, stop  # noqa: E402

CUDA = ("--device", "cuda", "--dtype", "bfloat16", "--attention-backend", "flashinfer")
COMMON = ("--max-model-len", "2048", "--kv-pages", "512")
PROMPTS = [
    "The capital of France is",
    "Write one sentence about rivers.",
    "List three prime numbers:",
]


async def ask(http: aiohttp.ClientSession, url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return answer["choices"][0]["text"]


async def health(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/health") as resp:
        return await resp.json()


async def main() -> int:
    os.environ.setdefault("PD_CLUSTER_TOKEN", "gpu-check-token")
    procs = []
    failed = 0
    try:
        both, both_url = start_worker("--role", "both", *CUDA, *COMMON, device=None)
        procs.append(both)
        p, p_url = start_worker("--role", "prefill", *CUDA, *COMMON, device=None)
        procs.append(p)
        d, d_url = start_worker("--role", "decode", *CUDA, *COMMON, device=None)
        procs.append(d)
        g, g_url = start_worker(
            "--role", "both", *CUDA, *COMMON, "--cuda-graph-max-batch", "8", device=None
        )
        procs.append(g)
        with socket.socket() as sock:  # a free port for the router
            sock.bind(("127.0.0.1", 0))
            router_port = str(sock.getsockname()[1])
        router = subprocess.Popen(
            [sys.executable, "-m", "pd.router.main", "--port", router_port,
             "--prefill", p_url, "--decode", d_url, "--local-prefill-max-tokens", "0"],
        )  # fmt: skip
        procs.append(router)
        url = f"http://127.0.0.1:{router_port}"
        async with aiohttp.ClientSession() as http:
            for w in (both_url, p_url, d_url, g_url):
                h = await health(http, w)
                ok = h.get("attention_backend") == "FlashInferAttentionBackend"
                failed += not ok
                print(
                    f"[{'ok' if ok else 'FAIL'}] {h['role']} worker attention: {h.get('attention_backend')}"
                )
            for _ in range(100):
                try:
                    async with http.get(f"{url}/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
            for prompt in PROMPTS:
                ref, got = await ask(http, both_url, prompt), await ask(http, url, prompt)
                ok = ref == got
                failed += not ok
                print(f"[{'ok' if ok else 'FAIL'}] PD greedy == co-located for {prompt!r}: {got!r}")
                graphed = await ask(http, g_url, prompt)
                ok = ref == graphed
                failed += not ok
                print(
                    f"[{'ok' if ok else 'FAIL'}] CUDA-graph worker greedy == co-located for "
                    f"{prompt!r}: {graphed!r}"
                )
            h = await health(http, g_url)
            ok = h.get("cuda_graph_max_batch") == 8
            failed += not ok
            print(
                f"[{'ok' if ok else 'FAIL'}] graph worker reports cuda_graph_max_batch: {h.get('cuda_graph_max_batch')}"
            )
            for w in (p_url, d_url, g_url):
                h = await health(http, w)
                load = h["load"]
                ok = h["integrity"] == "ok" and load["kv_pages_free"] == load["kv_pages_total"]
                failed += not ok
                print(
                    f"[{'ok' if ok else 'FAIL'}] {h['role']} pages back: {h['integrity']}, {load['kv_pages_free']}/{load['kv_pages_total']}"
                )
    finally:
        for proc in procs:
            stop(proc)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
