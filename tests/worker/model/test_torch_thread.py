"""The worker's torch thread: every worker a process builds runs torch's default thread count
when `--threads` is 0, not only the first (whose torch thread drops its caller to one thread)."""

from __future__ import annotations

import pytest
import torch

from pd.config import WorkerConfig
from pd.worker.build import build_worker
from pd.worker.model.torch_thread import DEFAULT_THREADS, TorchThread
from tests.model_fixtures import default_checkpoint


@pytest.fixture(autouse=True)
def caller_threads():
    """Each test here drops this thread to one torch thread: give it back its count after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_second_worker_in_one_process_gets_the_default_threads_too():
    cfg = WorkerConfig(dtype="float32", quantization="none", device="cpu", kv_pages=16, port=0)
    workers = [build_worker(cfg, default_checkpoint()) for _ in range(2)]
    counts = [w.engine._given_executor.submit(torch.get_num_threads).result() for w in workers]
    assert counts == [DEFAULT_THREADS, DEFAULT_THREADS]
    assert torch.get_num_threads() == 1  # the caller (the event loop's thread) runs no team


def test_the_torch_thread_runs_at_its_count_and_its_caller_at_one():
    thread = TorchThread(3)
    try:
        assert thread.run(torch.get_num_threads) == 3
        assert torch.get_num_threads() == 1
    finally:
        thread.close()
