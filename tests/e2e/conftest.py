"""In-process worker servers on the real default model (fp32, CPU), one model load per session.

After every test the worker must be idle with every KV page free and its page accounting intact.
"""

from __future__ import annotations

import asyncio

import pytest

from pd.config import WorkerConfig
from pd.worker.api.server import make_app
from pd.worker.build import Worker, build_worker
from pd.worker.checkpoint.load_utils import LoadedCheckpoint
from tests.model_fixtures import default_checkpoint


def make_worker(ckpt: LoadedCheckpoint | None = None, **overrides) -> Worker:
    fields = dict(dtype="float32", device="cpu", kv_pages=256, max_model_len=2048, port=0)
    fields.update(overrides)
    return build_worker(WorkerConfig(**fields), ckpt or default_checkpoint())


@pytest.fixture(scope="session")
def worker() -> Worker:
    return make_worker()


async def wait_idle(worker: Worker, timeout: float = 30.0) -> None:
    """Wait until the engine has no request left (aborts are processed at once)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not worker.engine.idle or worker.engine.handles:
        assert loop.time() < deadline, "the worker did not become idle"
        await asyncio.sleep(0.02)


def assert_all_pages_free(worker: Worker) -> None:
    worker.check_integrity()
    alloc = worker.engine.scheduler.cache
    assert alloc.num_free == alloc.num_total, f"{alloc.num_used} pages still in use"


@pytest.fixture
async def client(worker, aiohttp_client):
    c = await aiohttp_client(make_app(worker), server_kwargs={"handler_cancellation": True})
    yield c
    await wait_idle(worker)
    assert_all_pages_free(worker)


def chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], **kw}
