"""`pd-bench transfer`: KV pull throughput between two processes on this machine.

(a) ours: a KVReceiver pull (plan, post, poller, done) of a prompt's KV pages;
(b) bare NIXL: a READ of the same bytes, one descriptor per page, polled in a tight loop;
(c) memcpy: an in-process gather copy of the same pages.
The prefill side is `python -m pd.transfer.peerproc`; page ids are random and distinct (so ours
cannot coalesce and moves the same descriptors as the bare read) unless --contiguous.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import numpy as np
import orjson
import torch

from pd.transfer import (
    KVPoll,
    ManagerState,
    TransferConfig,
    TransferParams,
    create_manager,
    import_nixl,
)
from pd.transfer.messages import unb64
from pd.transfer.peerproc import PeerProcess, PoolSpec, pool_desc, pool_tensors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length")
    parser.add_argument("--layers", type=int, default=30)  # SmolLM2-135M
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10, help="timed iterations (after 2 warm-ups)")
    parser.add_argument("--contiguous", action="store_true", help="adjacent pages (ours coalesces)")
    parser.add_argument("--seed", type=int, default=0)


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _page_ids(args: argparse.Namespace, n: int, pool: int, rng: random.Random) -> list[int]:
    if args.contiguous:
        start = rng.randrange(pool - n + 1)
        return list(range(start, start + n))
    return rng.sample(range(pool), n)


async def _interleaved(
    args: argparse.Namespace,
    peer: PeerProcess,
    spec: PoolSpec,
    n: int,
    page_bytes: int,
    rng: random.Random,
) -> tuple[list[float], list[float], list[float], ManagerState]:
    """Ours and bare NIXL alternate, so both see the same machine load."""
    # The reading side progresses UCX from its own checks (ours: the poller; bare: its loop), so
    # neither D agent runs NIXL's progress thread, which spins a core.
    cfg = TransferConfig(
        backend="nixl", serve=False, cluster_token=args.token, nixl_progress_thread=False
    )
    mgr = create_manager(cfg)
    await mgr.start()
    dst_mem = pool_tensors(spec, fill=False)
    mgr.register_pool(pool_desc(spec, dst_mem))
    bare = _BareNixl(peer, spec, page_bytes)
    pull, total, bare_times = [], [], []
    try:
        for i in range(args.iters + 2):
            params = TransferParams.from_dict(
                await peer.send({"kv": _page_ids(args, n, spec.num_slots, rng)})
            )
            t0 = time.perf_counter()
            rx = mgr.create_receiver(params)
            while rx.poll() is KVPoll.Bootstrapping:  # attach confirmed by P (handshake cached)
                await asyncio.sleep(0)
            t1 = time.perf_counter()
            rx.init({"kv": _page_ids(args, n, spec.num_slots, rng)})
            if await rx.wait() is not KVPoll.Success:
                raise RuntimeError(f"pull failed: {rx.failure_reason}")
            t2 = time.perf_counter()
            ev = await peer.aevent()
            assert ev["reason"] == "done", ev
            tb = bare.once(args, n, rng)
            if i >= 2:
                pull.append(t2 - t1)
                total.append(t2 - t0)
                bare_times.append(tb)
        return pull, total, bare_times, mgr.state()
    finally:
        bare.close()
        await mgr.close()


class _BareNixl:
    """A plain NIXL agent reading the same pool, one descriptor per page."""

    def __init__(self, peer: PeerProcess, spec: PoolSpec, page_bytes: int) -> None:
        nixl = import_nixl()
        self.agent = nixl.nixl_agent(
            "bench-bare", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self.dst = pool_tensors(spec, fill=False)[0]
        self.agent.register_memory(self.dst)
        self.remote = self.agent.add_remote_agent(unb64(peer.ready["agent_metadata"]))
        self.remote_base = peer.ready["pools"][0]["ranks"][0][0]
        self.spec, self.page_bytes = spec, page_bytes

    def once(self, args: argparse.Namespace, n: int, rng: random.Random) -> float:
        agent, dst, spec, page_bytes = self.agent, self.dst, self.spec, self.page_bytes
        remote, remote_base = self.remote, self.remote_base
        src = np.array(_page_ids(args, n, spec.num_slots, rng), dtype=np.uint64)
        dsti = np.array(_page_ids(args, n, spec.num_slots, rng), dtype=np.uint64)
        local = np.stack(
            [
                dst.data_ptr() + dsti * page_bytes,
                np.full(n, page_bytes, np.uint64),
                np.zeros(n, np.uint64),
            ],
            axis=1,
        ).astype(np.uint64)
        rem = np.stack(
            [
                remote_base + src * page_bytes,
                np.full(n, page_bytes, np.uint64),
                np.zeros(n, np.uint64),
            ],
            axis=1,
        ).astype(np.uint64)
        t0 = time.perf_counter()
        h = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(rem, "DRAM"), remote
        )
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        t1 = time.perf_counter()
        if state != "DONE":
            raise RuntimeError(f"bare NIXL read ended in {state}")
        h.release()
        return t1 - t0

    def close(self) -> None:
        self.agent.remove_remote_agent(self.remote)


def _memcpy(
    args: argparse.Namespace, spec: PoolSpec, n: int, page_bytes: int, rng: random.Random
) -> list[float]:
    src = torch.randint(0, 255, (spec.num_slots, page_bytes), dtype=torch.uint8)
    out = torch.empty((n, page_bytes), dtype=torch.uint8)
    times = []
    for i in range(args.iters + 2):
        idx = _page_ids(args, n, spec.num_slots, rng)
        t0 = time.perf_counter()
        for j, i_src in enumerate(idx):  # one memcpy per page, like one descriptor per page
            out[j].copy_(src[i_src])
        t1 = time.perf_counter()
        if i >= 2:
            times.append(t1 - t0)
    return times


def run(args: argparse.Namespace) -> int:
    args.token = "pd-bench-transfer-token"
    n = -(-args.tokens // args.page_size)
    spec = PoolSpec(
        "kv",
        2 * n,
        tp=1,
        layers=args.layers,
        heads=args.kv_heads,
        page_size=args.page_size,
        head_dim=args.head_dim,
        random=False,
    )
    page_bytes = (
        args.layers * 2 * args.kv_heads * args.page_size * args.head_dim * 2
    )  # 2-byte dtype
    nbytes = n * page_bytes
    rng = random.Random(args.seed)
    peer = PeerProcess(
        {"config": {"backend": "nixl", "cluster_token": args.token}, "pools": [spec.to_dict()]}
    )
    try:
        pull, total, bare, state = asyncio.run(_interleaved(args, peer, spec, n, page_bytes, rng))
    finally:
        peer.close()
    mem = _memcpy(args, spec, n, page_bytes, rng)
    result = {
        "tokens": args.tokens,
        "pages": n,
        "page_bytes": page_bytes,
        "bytes": nbytes,
        "layout": "contiguous" if args.contiguous else "random pages",
        "iters": args.iters,
        "ours_gbps": round(_gbps(nbytes, pull), 3),
        "ours_incl_attach_gbps": round(_gbps(nbytes, total), 3),
        "bare_nixl_gbps": round(_gbps(nbytes, bare), 3),
        "memcpy_gbps": round(_gbps(nbytes, mem), 3),
        "ours_ms": round(statistics.median(pull) * 1e3, 2),
        "bare_nixl_ms": round(statistics.median(bare) * 1e3, 2),
        "poller_polls": state.polls,
    }
    result["ratio_vs_bare"] = round(result["ours_gbps"] / result["bare_nixl_gbps"], 3)
    if args.json:
        print(orjson.dumps(result).decode())
    else:
        print(
            f"KV of a {args.tokens}-token prompt: {n} pages x {page_bytes} B = {nbytes / 1e6:.1f} MB "
            f"({result['layout']}), median of {args.iters}"
        )
        print(
            f"  (a) ours       {result['ours_gbps']:7.2f} GB/s  ({result['ours_ms']} ms; "
            f"{result['ours_incl_attach_gbps']:.2f} GB/s incl. attach)"
        )
        print(
            f"  (b) bare NIXL  {result['bare_nixl_gbps']:7.2f} GB/s  ({result['bare_nixl_ms']} ms)"
        )
        print(f"  (c) memcpy     {result['memcpy_gbps']:7.2f} GB/s")
        print(f"  a/b = {result['ratio_vs_bare']:.2f} (target >= 0.7)")
    return 0
