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
from tests.e2e.processes import start_workers, stop
from tests.model_fixtures import default_checkpoint

# The fp32 prefill + decode pair the feature modules share (test_tools, test_logprobs,
# test_n_choices): one start per session, both processes at once (each ~6 s to import and load).
PAIR_FLAGS = ("--dtype", "float32", "--quantization", "none", "--kv-pages", "256", "--max-model-len", "2048",
              "--threads", "1")  # fmt: skip


def make_worker(ckpt: LoadedCheckpoint | None = None, **overrides) -> Worker:
    fields = dict(
        dtype="float32", quantization="none", device="cpu", kv_pages=256, max_model_len=2048, port=0
    )
    fields.update(overrides)
    return build_worker(WorkerConfig(**fields), ckpt or default_checkpoint())


@pytest.fixture(scope="session")
def worker() -> Worker:
    return make_worker()


def start_roles(*roles: str, flags: tuple[str, ...] = PAIR_FLAGS) -> list:
    """Start a `pd-worker` process per role at once; [(process, url)] in that order."""
    return start_workers(*(("--role", role, *flags) for role in roles))


@pytest.fixture(scope="session")
def fp32_pair():
    """(P's URL, D's URL): real processes with NIXL between them, shared by the modules that
    need a pair with these flags; their tests leave every page free."""
    procs = start_roles("prefill", "decode")
    try:
        yield tuple(url for _, url in procs)
    finally:
        for proc, _ in procs:
            stop(proc)


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
