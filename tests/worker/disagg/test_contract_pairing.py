"""The pairing contract of a P/D pair: the stored checkpoint's digest and the KV format are
compared (in D's check of P's params, and at the handshake), and the runtime format (compute
dtype, the linear layers' and the LM head's formats, attention) at the handshake.

Real KVContracts of tiny random checkpoints of one shape; a real prefill side and decode side in
one process (real engines, transfer managers over the `fake` backend, stand-in models).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pd.kvcache.cache_manager import KVCacheManager
from pd.protocol import APIError, GenerationOptions
from pd.transfer import TransferConfig, create_manager
from pd.worker.checkpoint.loader import load_checkpoint
from pd.worker.disagg import DecodeSide, KVContract, PrefillSide
from pd.worker.disagg.contract import runtime_format
from pd.worker.engine import Engine, RequestHandle, Scheduler
from pd.worker.model import ModelConfig, ModelRunner, RunnerConfig, SampleOutput
from tests.admit import add_remote
from tests.worker.checkpoint.test_digest import gguf_file

PAGE = 4
CONFIG = ModelConfig("m", "llama", 64, 16, 32, 2, 2, 1, 8, 1e4, 1e-5, 128, True)
TOKEN = "contract-test-token-0123456789"
FAST = dict(heartbeat_interval_s=0.1, heartbeat_misses=3, handshake_timeout_s=2.0)
# D embeds ids below min(tokenizer's vocabulary, model's): the model's, here.
TOKENIZER = SimpleNamespace(
    eos_token_ids=frozenset({0}), decode=lambda *a, **k: "x", vocab_size=10**9
)
PROMPT = list(range(1, 10))


# -- real contracts of real checkpoints ----------------------------------------------------------


def _runner(path: str, quantization: str = "none") -> ModelRunner:
    ckpt = load_checkpoint(path)
    rc = RunnerConfig(
        tp=1, dtype=torch.float32, device="cpu", num_pages=8,
        page_size=PAGE, max_model_len=64, quantization=quantization,
        checkpoint_digest=ckpt.digest,
    )  # fmt: skip
    return ModelRunner(ckpt.config, ckpt.weights, rc)


def test_a_fine_tune_of_the_same_shape_has_another_contract(tmp_path: Path) -> None:
    base = _runner(gguf_file(tmp_path, "base", seed=0))
    tuned = _runner(gguf_file(tmp_path, "tuned", seed=1))
    same_name = dataclasses.replace(tuned.config, name=base.config.name)
    assert base.config == same_name  # the same shape; the names (file stems) never count
    a, b = KVContract.of(base), KVContract.of(tuned)
    assert a.model_fingerprint != b.model_fingerprint
    assert (a.page_size, a.kv_layout, a.dtype) == (b.page_size, b.kv_layout, b.dtype)


def test_the_same_checkpoint_quantized_otherwise_has_another_runtime_format(tmp_path: Path) -> None:
    path = gguf_file(tmp_path, "base", seed=0)
    dense, int8 = _runner(path), _runner(path, "int8")
    assert KVContract.of(dense) == KVContract.of(int8)  # the same KV bytes' shape
    assert runtime_format(int8) == {
        "compute_dtype": "float32", "linear": "int8", "lm_head": "int8",
        "attention": "TorchAttentionBackend",
    }  # fmt: skip
    assert runtime_format(dense)["linear"] == "none" and runtime_format(dense)["lm_head"] == "none"
    # The KV dtype is part of the KV format: a bf16 runner's pages are other bytes.
    ckpt = load_checkpoint(path)
    rc = RunnerConfig(
        tp=1, dtype=torch.bfloat16, device="cpu", num_pages=8,
        page_size=PAGE, max_model_len=64, checkpoint_digest=ckpt.digest,
    )  # fmt: skip
    bf16 = ModelRunner(ckpt.config, ckpt.weights, rc)
    assert KVContract.of(bf16) != KVContract.of(dense)
    assert KVContract.of(bf16).model_fingerprint == KVContract.of(dense).model_fingerprint


# -- a P/D pair --------------------------------------------------------------------------------


class Runner:
    """Stands in for the ModelRunner: a KV buffer, a step that samples token 7, and what the
    contract reads (the checkpoint digest) and the runtime report (quantization, kernels)."""

    config = CONFIG
    page_size = PAGE
    dtype = torch.float32
    attention_backend = "TorchAttentionBackend"

    def __init__(self, digest: str, quantization: str = "none") -> None:
        self.kv_pools = [SimpleNamespace(buffer=torch.zeros(32, 2, 2, 1, PAGE, 8))]
        self.checkpoint_digest, self.quantization = digest, quantization

    def execute(self, batch) -> SampleOutput:
        n = sum(batch.sample)
        return SampleOutput([7] * n, [None] * n, [None] * n)


class Pair:
    def __init__(self, p_runner: Runner, d_runner: Runner) -> None:
        p_sched = Scheduler(KVCacheManager(32, PAGE), chunk_size=64, max_running=8)
        p_mgr = create_manager(TransferConfig(backend="fake", cluster_token=TOKEN, **FAST))
        self.prefill = PrefillSide(p_mgr, p_runner, p_sched, tp_size=1)
        self.p = Engine(
            p_runner, p_sched, TOKENIZER, max_model_len=64, max_waiting=8,
            connector=self.prefill,
        )  # fmt: skip
        d_sched = Scheduler(KVCacheManager(32, PAGE), chunk_size=64, max_running=8)
        self.d = Engine(
            d_runner, d_sched, TOKENIZER, max_model_len=64, max_waiting=8,
        )  # fmt: skip
        d_mgr = create_manager(
            TransferConfig(backend="fake", cluster_token=TOKEN, serve=False, **FAST)
        )
        self.decode = DecodeSide(d_mgr, d_runner, self.d)

    async def __aenter__(self) -> Pair:
        self.p.start()
        self.d.start()
        await self.prefill.start()
        await self.decode.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.decode.stop()
        await self.prefill.stop()
        await self.d.stop()
        await self.p.stop()

    async def prefilled(self) -> dict:
        h = add_remote(self.p, self.prefill, PROMPT, GenerationOptions(max_tokens=1))
        delta = await asyncio.wait_for(h.queue.get(), 5)
        assert delta.error is None and h.kv_transfer_params is not None
        self.p.abort(h)
        return h.kv_transfer_params


async def drain(h: RequestHandle) -> tuple[list[int], APIError | None]:
    tokens: list[int] = []
    while True:
        delta = await asyncio.wait_for(h.queue.get(), 5)
        if delta.error is not None:
            return tokens, delta.error
        tokens += delta.token_ids
        if delta.finish_reason is not None:
            return tokens, None


async def test_a_pair_of_other_checkpoints_is_refused_naming_both_sides() -> None:
    async with Pair(Runner("ckpt-base"), Runner("ckpt-tuned")) as pair:
        params = await pair.prefilled()
        p_fp = pair.prefill.contract.model_fingerprint
        d_fp = pair.decode.contract.model_fingerprint
        assert p_fp != d_fp and params["model_fingerprint"] == p_fp
        # D's check of P's params: a 400 naming both fingerprints.
        with pytest.raises(APIError, match="model_fingerprint") as e:
            pair.decode.validate(params)
        assert e.value.status == 400 and p_fp in e.value.message and d_fp in e.value.message
        # Params that pass that check (forged, or from a P that lies) still meet the handshake.
        forged = {**params, "model_fingerprint": d_fp}
        with pytest.raises(APIError) as e:
            await pair.decode.admit(pair.decode.validate(forged), GenerationOptions(max_tokens=3))
        assert e.value.status == 502 and e.value.code == "kv_transfer_failed"
        message = e.value.message
        assert "ContractMismatch" in message and "model_fingerprint" in message
        assert f"'{p_fp}'" in message and f"'{d_fp}'" in message, message
        assert "prefill" in message and "decode" in message
        # Nothing held on D; P's pages go with the router's release (or the lease).
        assert pair.decode.manager.state().links == 0
        assert pair.prefill.release(params["transfer_id"], "test over")


async def test_the_same_checkpoint_with_other_kernels_is_refused_naming_both(caplog) -> None:
    async with Pair(Runner("ckpt", "int8"), Runner("ckpt", "none")) as pair:
        params = await pair.prefilled()
        kvp = pair.decode.validate(params)  # the KV contract is the same
        with pytest.raises(APIError) as e:
            await pair.decode.admit(kvp, GenerationOptions(max_tokens=3))
        message = e.value.message
        assert e.value.status == 502 and "ContractMismatch" in message
        assert "runtime.linear: prefill 'int8', decode 'none'" in message, message
        assert pair.decode.manager.state().links == 0
        assert pair.prefill.release(params["transfer_id"], "test over")
    async with Pair(Runner("ckpt", "int8"), Runner("ckpt", "int8")) as pair:
        with caplog.at_level(logging.INFO, logger="pd.transfer"):
            kvp = pair.decode.validate(await pair.prefilled())
            h = await pair.decode.admit(kvp, GenerationOptions(max_tokens=3))
            tokens, error = await drain(h)
        assert error is None and tokens == [7, 7, 7]
        pair.d.abort(h)
        reports = [r.getMessage() for r in caplog.records if "paired with" in r.getMessage()]
        assert len(reports) == 1 and "linear=int8" in reports[0], reports


async def test_real_runners_of_two_checkpoints_of_one_shape_are_refused(tmp_path: Path) -> None:
    base, tuned = gguf_file(tmp_path, "base", seed=0), gguf_file(tmp_path, "tuned", seed=1)
    async with Pair(_runner(base), _runner(tuned)) as pair:
        params = await pair.prefilled()
        with pytest.raises(APIError, match="model_fingerprint") as e:
            pair.decode.validate(params)
        assert e.value.status == 400
        forged = {**params, "model_fingerprint": pair.decode.contract.model_fingerprint}
        with pytest.raises(APIError, match="ContractMismatch") as e:
            await pair.decode.admit(pair.decode.validate(forged), GenerationOptions(max_tokens=3))
        assert "model=base" in e.value.message and "model=tuned" in e.value.message
        assert pair.prefill.release(params["transfer_id"], "test over")
    async with Pair(_runner(base, "int8"), _runner(base, "int8")) as pair:
        kvp = pair.decode.validate(await pair.prefilled())
        tokens, error = await drain(await pair.decode.admit(kvp, GenerationOptions(max_tokens=3)))
        assert error is None and len(tokens) == 3
