"""`pd-worker --simulate`: the flags at the command line (in-process), and real processes of a
70B model on 4 x H100 that start in seconds and hold a few hundred MB, paired through the
router with the simulated transfer."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from pd.config import WorkerConfig
from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.sim import parse_profile
from pd.worker.build import SIMULATED_CONTEXT, build_worker
from pd.worker.main import main, parse_args
from tests.e2e.processes import start_worker, stop, wait_pages_free

MAX_RSS_MB = 600  # measured: ~275 MB each (torch's import is ~220 MB of it)
MAX_START_S = 60  # measured: 3-5 s idle, ~20 s on a machine loaded 5x over (torch's import)


def test_simulate_list_prints_the_presets_and_exits_0(capsys):
    assert main(["--simulate", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("llama-3.1-70b", "h100", "rdma-400g", "PROFILE"):
        assert name in out


@pytest.mark.parametrize(
    "profile, says",
    [
        ("llama-3.1-8b:a100", "unknown device 'a100'"),
        ("llama-3.1-70b:h100", "does not fit on 1 x h100"),
        ("nonsense", "MODEL:DEVICE"),
        ("llama-3.1-8b:h100:tp3", "does not divide"),
    ],
)
def test_a_bad_profile_is_refused_at_start(profile, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--simulate", profile])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_a_simulated_worker_sizes_itself_from_the_profile():
    w = build_worker(
        WorkerConfig(
            simulate="llama-3.1-70b:h100:tp4", role="decode", port=0, cluster_token="t" * 16
        )
    )
    profile = parse_profile("llama-3.1-70b:h100:tp4")
    assert w.engine.scheduler.cache.num_total == profile.kv_pages(16)
    assert w.engine.max_model_len == SIMULATED_CONTEXT and w.model_name == "llama-3.1-70b"
    assert w.decode is not None and w.decode.pool.tp_size == 4
    assert w.decode.page_bytes == 16 * profile.model.kv_bytes_per_token
    assert w.attention_backend == "simulated" and w.simulation is not None
    small = build_worker(
        WorkerConfig(simulate="llama-3.1-8b:h100", kv_pages=100, max_model_len=4096, port=0)
    )
    assert small.engine.scheduler.cache.num_total == 100 and small.engine.max_model_len == 4096
    with pytest.raises(ValueError, match="the profile sets TP"):
        build_worker(WorkerConfig(simulate="llama-3.1-8b:h100", tp=2, port=0))
    with pytest.raises(ValueError, match="--compile"):
        WorkerConfig(simulate="llama-3.1-8b:h100", compile=True)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
async def test_simulated_70b_processes_start_fast_stay_small_and_pair(aiohttp_server):
    flags = ("--simulate", "llama-3.1-70b:h100:tp4", "--time-scale", "0.5")
    t0 = time.monotonic()
    procs = []
    try:
        with ThreadPoolExecutor(2) as pool:  # both at once
            starting = [
                pool.submit(start_worker, "--role", r, *flags) for r in ("prefill", "decode")
            ]
            for f in starting:
                procs.append(f.result())
        started = time.monotonic() - t0
        (p, p_url), (d, d_url) = procs
        cfg = RouterConfig(port=0, prefill=(p_url,), decode=(d_url,), health_interval=0.2)
        router = str((await aiohttp_server(make_router(cfg))).make_url("")).rstrip("/")
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 10
            while (await http.get(f"{router}/health")).status != 200:
                assert time.monotonic() < deadline, "the router never saw both workers healthy"
                await asyncio.sleep(0.05)
            body = {"prompt": "The rivers of Europe " * 200, "max_tokens": 16, "temperature": 0}
            resp = await http.post(f"{router}/v1/completions", json=body)
            answer = await resp.json()
            assert resp.status == 200, answer
            assert answer["usage"]["completion_tokens"] == 16
            assert len(answer["choices"][0]["text"].split()) == 16
            for url in (p_url, d_url):
                load = await wait_pages_free(http, url)
                assert load["kv_pages_total"] == parse_profile(flags[1]).kv_pages(16)
            sizes = [rss_mb(proc.pid) for proc, _ in procs]
        print(f"2 simulated 70B workers started in {started:.1f} s; RSS {sizes} MB")
        assert all(s < MAX_RSS_MB for s in sizes), sizes
        assert started < MAX_START_S
    finally:
        for proc, _ in procs:
            stop(proc)
