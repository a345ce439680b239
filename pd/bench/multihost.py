"""`pd-bench multihost`: the prefill/decode stack across three "hosts" (network namespaces).

The router, the prefill worker (P) and the decode worker (D) each run in a network namespace of
their own (`pd.bench.netns_lab` has the topology: point-to-point links router<->P, router<->D,
P<->D, and root<->router for this client), with NIXL over TCP on the P<->D link only
(`UCX_TLS=tcp`, `UCX_NET_DEVICES=kv0`). Each worker binds `--host` to its namespace's node
address, which is also where P's KV bootstrap channel listens and what P puts in its
`kv_transfer_params` (the worker maps `--host` onto the transfer layer's `bootstrap_host`; it has
no separate advertise host), so D reaches P's channel over the P<->D link.

1. latency: for each one-way delay added to each direction of the P<->D link (`--delays`,
   default 0, 5, 20, 50 ms), `--requests` streamed chat requests in turn (a prompt of about
   `--prompt-tokens` tokens, `--max-tokens` tokens each, `ignore_eos`). Per request: TTFT at the
   client; P's answer time (the router's `pd_router_prefill_seconds`); D's admit time (TTFT minus
   that: the router's call to D, D's dial of P and its first lease renewal, all before D sends
   token 0); the gap from token 0 to token 1 (D pulls the KV in between), the median later
   inter-token gap, and the transfer estimate (the first gap minus that median); the bytes that
   crossed the P<->D link (kernel counters of D's `kv0`); and, when a worker exports a histogram
   named like `*kv_transfer*seconds`/`*kv_pull*seconds`, its mean; and, for reference, how
   long plain TCP takes to move as many bytes from P to D over the same link. The bytes must
   have crossed the link (UCX would otherwise use shared memory across namespaces: it did here
   without `UCX_TLS=tcp`), and after each delay both workers must be settled (below).
2. cut: the link is slowed (`--cut-rate-mbit`, `--cut-delay-ms`), `--cut-requests` long-prompt
   requests start (streamed and not, alternately); once D holds a transfer and at least
   `--cut-after-bytes` have crossed the link, the link is cut (netem loss 100%, or the wire's
   down). Every in-flight request must end in an error the client can read (a 5xx JSON error, or
   an error event in the SSE stream; not a hang, not a stream that just stops) within the
   router's deadline (`--prefill-timeout` + `--read-timeout`). With the link still cut, D must
   settle and P must settle within a lease TTL (`--lease-ttl-s`) plus `--settle-slack-s` of the
   cut. Still cut (a partition), `--partition-requests` new requests must fail the same way, and
   both workers settle again within a lease TTL plus the slack (P pinned pages no D will ever
   pull). Then the link is restored (and unshaped), and `--post-requests` new requests must
   succeed and leave both workers settled. Network counters (TCP retransmissions per namespace,
   drops on the link) come with each phase.

Settled: `/health` `integrity == "ok"`, `kv_pages_free == kv_pages_total`, no request running or
waiting, `inflight_transfers == 0`, `kv_pages_pinned == kv_pages_reserved == 0`.

Needs root, iproute2 (`ip`, `tc`) and a NIXL package; the KV link is netem where the kernel has
`sch_netem`, else the lab's userspace wire (`--kv-link`). Prints a latency table and the cut's
results (`--json`: one JSON document) and exits 1 when a check failed. Worker, router and wire
logs stay in `--workdir` (default: a new temporary directory; its path is in the report).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import secrets
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pd.bench.netns_lab import (
    KV_LINKS,
    Lab,
    LabError,
    LabProcess,
    Shaping,
    list_netns,
    ns_exec_cmd,
    prerequisites,
)
from pd.bench.netns_lab import worker_env as lab_worker_env

WORKER_PORT = 8100
BOOTSTRAP_PORT = 8200
ROUTER_PORT = 8000
# Far below any model's KV per token (SmolLM2-135M in bf16: 23,040 bytes), far above the
# bootstrap channel's bytes per request.
MIN_KV_BYTES_PER_TOKEN = 1024
TRANSFER_METRIC = re.compile(r"kv_(transfer|pull)\w*seconds")
TCP_REF_PORT = 9100
# The reference for the KV pull: plain TCP moving as many bytes from P to D over the same link,
# on one connection kept across transfers, idle in between (as D's UCX connection to P is).
TCP_REF_SERVER = """
import socket, sys, threading
buf = memoryview(bytearray(64 << 20))
def serve(c):
    with c:
        while (head := c.recv(8, socket.MSG_WAITALL)) and len(head) == 8:
            n = int.from_bytes(head, "big")
            while n:
                n -= c.send(buf[: min(n, len(buf))])
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""
TCP_REF_CLIENT = """
import json, socket, sys, time
host, port, n, reps, idle = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
c = socket.create_connection((host, port), timeout=60)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out = []
for _ in range(reps):
    t = time.perf_counter()
    c.sendall(n.to_bytes(8, "big"))
    got = 0
    while got < n:
        got += len(c.recv(1 << 20))
    out.append(time.perf_counter() - t)
    time.sleep(idle)
print(json.dumps(out))
"""
WORDS = (
    "river stone market garden window paper orange silver cloud engine winter table music "
    "forest bridge candle letter mountain harbor planet signal village copper lantern meadow "
    "thunder island rocket pencil canyon castle desert feather glacier honey jungle kettle "
    "ladder marble needle ocean pepper quartz ribbon saddle tunnel velvet walnut yellow zebra"
).split()


@dataclass
class Options:
    delays_ms: tuple[float, ...] = (0.0, 5.0, 20.0, 50.0)
    requests: int = 3  # per delay
    prompt_tokens: int = 300
    max_tokens: int = 16
    cut_requests: int = 2
    cut_prompt_tokens: int = 800
    cut_rate_mbit: float = 16.0
    cut_delay_ms: float = 5.0
    cut_after_bytes: int = 1 << 20
    partition_requests: int = 2  # sent while the link is still cut (0: none)
    post_requests: int = 2
    lease_ttl_s: float = 10.0
    prefill_timeout_s: float = 30.0
    read_timeout_s: float = 15.0
    settle_slack_s: float = 5.0
    kv_pages: int = 512
    threads: int = 1
    dtype: str = "auto"
    kv_link: str = "auto"
    mtu: int = 1500
    workdir: str | None = None
    startup_timeout_s: float = 240.0

    def __post_init__(self) -> None:
        if not self.delays_ms or min(self.delays_ms) < 0:
            raise ValueError("--delays: one or more delays >= 0 (ms)")
        counts = ("requests", "prompt_tokens", "max_tokens", "kv_pages", "threads")
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_tokens < 3:
            raise ValueError("--max-tokens must be >= 3 (the pull shows between tokens 0 and 1)")
        if min(self.cut_requests, self.partition_requests, self.post_requests) < 0:
            raise ValueError("request counts must be >= 0")
        if min(self.lease_ttl_s, self.prefill_timeout_s, self.read_timeout_s) <= 0:
            raise ValueError("--lease-ttl-s, --prefill-timeout-s, --read-timeout-s must be > 0")

    @property
    def deadline_s(self) -> float:
        """The longest a request may take through the router (prefill, then D's silence)."""
        return self.prefill_timeout_s + self.read_timeout_s


# -------------------------------------------------------------------------- client


@dataclass
class Answer:
    stream: bool
    status: int = 0
    ok: bool = False
    elapsed_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # since the request was sent
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error_kind: str | None = None  # http_error | sse_error | broken_stream | hang | client_error
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def clear_error(self) -> bool:
        """Failed in a way a client can read: a 5xx JSON error or an SSE error event."""
        return self.error_kind in ("http_error", "sse_error") and (
            self.error_kind == "sse_error" or self.status >= 500
        )

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d["ttft_s"] = self.ttft_s
        d["token_times_s"] = [round(t, 4) for t in self.token_times_s]
        return d


def make_prompt(tag: str, approx_tokens: int) -> str:
    """A prompt of about `approx_tokens` tokens, its own for each tag (no prefix-cache hits)."""
    rng = random.Random(tag)
    words = " ".join(rng.choice(WORDS) for _ in range(max(1, int(approx_tokens / 1.25))))
    return f"[{tag}] Write one sentence that uses some of these words: {words}"


def chat_body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _error_message(obj: Any) -> str:
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return str(obj["error"].get("message") or obj["error"])
    return str(obj)[:300]


async def _read_stream(resp: aiohttp.ClientResponse, a: Answer, t0: float) -> None:
    done = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj:
            a.error_kind, a.error = "sse_error", _error_message(obj)
            return
        choices = obj.get("choices") or []
        if choices and "role" not in (choices[0].get("delta") or {}):
            a.token_times_s.append(time.monotonic() - t0)
        if obj.get("usage"):
            a.prompt_tokens = obj["usage"].get("prompt_tokens")
            a.completion_tokens = obj["usage"].get("completion_tokens")
    if done:
        a.ok = True
    else:
        a.error_kind, a.error = "broken_stream", "the stream ended without [DONE] or an error"


async def chat(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float
) -> Answer:
    """One chat request; never raises (a failure is in the answer)."""
    stream = bool(body.get("stream"))
    a = Answer(stream=stream)
    t0 = time.monotonic()

    async def go() -> None:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            a.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    a.error = _error_message(json.loads(text))
                    a.error_kind = "http_error"
                except ValueError:
                    a.error_kind, a.error = "client_error", f"{resp.status}, not JSON: {text[:200]}"
                return
            if stream:
                await _read_stream(resp, a, t0)
                return
            answer = await resp.json()
            a.token_times_s.append(time.monotonic() - t0)  # no stream: the whole answer
            usage = answer.get("usage") or {}
            a.prompt_tokens = usage.get("prompt_tokens")
            a.completion_tokens = usage.get("completion_tokens")
            a.ok = bool(answer.get("choices"))

    try:
        await asyncio.wait_for(go(), timeout_s)
    except asyncio.TimeoutError:
        a.ok, a.error_kind = False, "hang"
        a.error = f"no end within {timeout_s:g}s"
    except (aiohttp.ClientError, ValueError) as e:
        a.ok, a.error_kind, a.error = False, "client_error", f"{type(e).__name__}: {e}"
    a.elapsed_s = time.monotonic() - t0
    return a


# ------------------------------------------------------------------- health, metrics


def settled(health: dict[str, Any]) -> bool:
    load = health.get("load") or {}
    return (
        health.get("integrity") == "ok"
        and load.get("kv_pages_free") == load.get("kv_pages_total")
        and load.get("running") == 0
        and load.get("waiting") == 0
        and load.get("inflight_transfers") == 0
        and load.get("kv_pages_pinned", 0) == 0
        and load.get("kv_pages_reserved", 0) == 0
    )


def health_digest(health: dict[str, Any]) -> dict[str, Any]:
    load = health.get("load") or {}
    keys = (
        "kv_pages_total",
        "kv_pages_free",
        "running",
        "waiting",
        "inflight_transfers",
        "kv_pages_held",
        "kv_pages_pinned",
        "kv_pages_reserved",
        "waiting_for_pages",
    )
    return {"integrity": health.get("integrity"), **{k: load.get(k) for k in keys if k in load}}


async def get_health(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
        health: dict[str, Any] = await r.json()
    if settled(health):  # then the full walk over the pages (/health's is counters)
        async with http.get(f"{url}/integrity", timeout=aiohttp.ClientTimeout(total=5)) as r:
            health.update(await r.json())
    return health


async def wait_settled(
    http: aiohttp.ClientSession, url: str, timeout_s: float, since: float | None = None
) -> dict[str, Any]:
    """Poll /health until settled; {ok, seconds (since `since`, default now), health}."""
    start = time.monotonic() if since is None else since
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while True:
        try:
            last = await get_health(http, url)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            last = {"integrity": f"no health: {e!r}"}
        if settled(last):
            return {
                "ok": True,
                "seconds": round(time.monotonic() - start, 2),
                "health": health_digest(last),
            }
        if time.monotonic() >= deadline:
            return {
                "ok": False,
                "seconds": round(time.monotonic() - start, 2),
                "health": health_digest(last),
            }
        await asyncio.sleep(0.1)


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
        return await r.text()


def histogram_totals(text: str, pattern: re.Pattern[str]) -> dict[str, tuple[float, float]]:
    """{family name: (sum, count)} of the histograms whose name matches."""
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram" or not pattern.search(family.name):
            continue
        total = sum(s.value for s in family.samples if s.name == f"{family.name}_sum")
        count = sum(s.value for s in family.samples if s.name == f"{family.name}_count")
        out[family.name] = (total, count)
    return out


# ------------------------------------------------------------------------ the stack


@dataclass
class Stack:
    lab: Lab
    router_url: str
    p_url: str
    d_url: str
    procs: list[LabProcess]  # P, D, router
    tcp_ref: LabProcess  # TCP_REF_SERVER in P


def start_stack(lab: Lab, o: Options) -> Stack:
    """Spawn P, D and the router in their namespaces (call on the main thread: the children
    die with the thread that started them)."""
    plan = lab.plan
    env = lab_worker_env(secrets.token_hex(16))  # one cluster token for P and D
    p_url, d_url = plan.url("prefill", WORKER_PORT), plan.url("decode", WORKER_PORT)
    worker = [sys.executable, "-m", "pd.worker.main"]
    common = (
        f"--device cpu --threads {o.threads} --dtype {o.dtype} --kv-pages {o.kv_pages} "
        f"--max-model-len 2048 --port {WORKER_PORT} --lease-ttl-s {o.lease_ttl_s:g}"
    ).split()
    p_flags = f"--role prefill --host {plan.node_addr('prefill')} --bootstrap-port {BOOTSTRAP_PORT}"
    d_flags = f"--role decode --host {plan.node_addr('decode')}"
    router_flags = (
        f"--host {plan.node_addr('router')} --port {ROUTER_PORT} --prefill {p_url} "
        f"--decode {d_url} --local-prefill-max-tokens 0 --health-interval 0.5 "
        f"--prefill-timeout {o.prefill_timeout_s:g} --read-timeout {o.read_timeout_s:g}"
    ).split()
    procs = [
        lab.spawn("prefill", "prefill", [*worker, *p_flags.split(), *common], env),
        lab.spawn("decode", "decode", [*worker, *d_flags.split(), *common], env),
        lab.spawn(
            "router",
            "router",
            [sys.executable, "-m", "pd.router.main", *router_flags],
            # The same token: the router signs the continuations of migrated streams with it.
            {"PYTHONUNBUFFERED": "1", "PD_CLUSTER_TOKEN": env["PD_CLUSTER_TOKEN"]},
        ),
    ]
    ref = [sys.executable, "-c", TCP_REF_SERVER, plan.node_addr("prefill"), str(TCP_REF_PORT)]
    tcp_ref = lab.spawn("tcp-ref", "prefill", ref)
    return Stack(lab, plan.url("router", ROUTER_PORT), p_url, d_url, procs, tcp_ref)


async def tcp_reference(
    stack: Stack, nbytes: int, reps: int = 3, idle_s: float = 0.3
) -> list[float]:
    """Seconds plain TCP takes to move `nbytes` from P to D over the KV link, `reps` times."""
    plan = stack.lab.plan
    argv = [
        sys.executable,
        "-c",
        TCP_REF_CLIENT,
        plan.node_addr("prefill"),
        str(TCP_REF_PORT),
        str(nbytes),
        str(reps),
        str(idle_s),
    ]
    proc = await asyncio.create_subprocess_exec(
        *ns_exec_cmd(plan.ns("decode"), argv),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    if proc.returncode != 0:
        raise LabError(f"the TCP reference failed: {err.decode(errors='replace')[-500:]}")
    times: list[float] = json.loads(out)
    return times


async def wait_ready(http: aiohttp.ClientSession, stack: Stack, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for url in (stack.p_url, stack.d_url, stack.router_url):
        while True:
            dead = [p for p in stack.procs if p.proc.poll() is not None]
            if dead:
                raise LabError(
                    f"{dead[0].name} exited {dead[0].proc.returncode}:\n{dead[0].tail()}"
                )
            try:
                async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise LabError(f"{url} not healthy within {timeout_s:g}s")
            await asyncio.sleep(0.5)


# ------------------------------------------------------------------------ phases


def _p50(values: Sequence[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.median(vs) if vs else None


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """What changed (zeros left out)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def _summarize(delay: float | str, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of the latency table: p50s over the requests that succeeded (and their max)."""
    good = [r for r in reqs if r["ok"]]

    def p50_ms(key: str) -> float | None:
        return _ms(_p50([r[key] for r in good]))

    ests = [r["transfer_est_s"] for r in good if r["transfer_est_s"] is not None]
    kv = _p50([r["kv_link_bytes"] for r in good])
    est = _p50(ests)
    worker: dict[str, float | None] = {}
    for name in sorted({k for r in good for k in r["worker_transfer_s"]}):
        worker[name] = _ms(_p50([r["worker_transfer_s"].get(name) for r in good]))
    return {
        "delay_ms": delay,
        "ok": len(good),
        "n": len(reqs),
        "prompt_tokens": _p50([r["prompt_tokens"] for r in good]),
        "ttft_ms": p50_ms("ttft_s"),
        "prefill_ms": p50_ms("prefill_s"),
        "admit_ms": p50_ms("admit_s"),
        "first_gap_ms": p50_ms("first_gap_s"),
        "itl_ms": p50_ms("itl_s"),
        "transfer_est_ms": _ms(est),
        "transfer_max_ms": _ms(max(ests)) if ests else None,
        "tcp_ref_ms": None,
        "kv_link_bytes": kv,
        "transfer_mb_s": round(kv / 1e6 / est, 1) if kv and est and est > 0 else None,
        "worker_transfer_ms": worker,
        "requests": reqs,
    }


class Scenario:
    def __init__(self, stack: Stack, o: Options, http: aiohttp.ClientSession) -> None:
        self.s, self.o, self.http = stack, o, http
        self.checks: list[dict[str, Any]] = []
        self.seq = 0

    def check(self, name: str, ok: bool, detail: Any = None) -> bool:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        return ok

    def body(self, tokens: int, stream: bool) -> dict[str, Any]:
        self.seq += 1
        prompt = make_prompt(f"req-{self.seq}-{secrets.token_hex(3)}", tokens)
        return chat_body(prompt, self.o.max_tokens, stream)

    def net_counters(self) -> dict[str, int]:
        """TCP retransmissions in P and D, drops on the KV link (kernel, and the wire's)."""
        lab, out = self.s.lab, {}
        for node in ("prefill", "decode"):
            for k, v in {**lab.tcp_counters(node), **lab.kv_drops(node)}.items():
                out[f"{node[0].upper()}:{k}"] = v
        stats = getattr(lab.link, "stats", None)
        if stats is not None:
            for direction in ("a_to_b", "b_to_a"):
                for k, v in stats()[direction].items():
                    if k.startswith("dropped") or k == "write_errors":
                        out[f"wire:{'P->D' if direction == 'a_to_b' else 'D->P'}:{k}"] = v
        return out

    async def _counters(self) -> dict[str, Any]:
        router = await scrape(self.http, self.s.router_url)
        prefill = histogram_totals(router, re.compile(r"^pd_router_prefill_seconds$"))
        transfer: dict[str, tuple[float, float]] = {}
        for name, url in (("P", self.s.p_url), ("D", self.s.d_url)):
            for metric, v in histogram_totals(
                await scrape(self.http, url), TRANSFER_METRIC
            ).items():
                transfer[f"{name}:{metric}"] = v
        return {
            "prefill": prefill.get("pd_router_prefill_seconds", (0.0, 0.0)),
            "kv_rx": self.s.lab.kv_bytes("decode")[0],
            "transfer": transfer,
        }

    async def one_measured(self) -> dict[str, Any]:
        before = await self._counters()
        a = await chat(
            self.http,
            self.s.router_url,
            self.body(self.o.prompt_tokens, True),
            self.o.deadline_s + 10,
        )
        after = await self._counters()
        t = a.token_times_s
        gaps = [b - x for x, b in zip(t, t[1:])]
        itl = _p50(gaps[1:])
        n_prefill = after["prefill"][1] - before["prefill"][1]
        prefill_s = (after["prefill"][0] - before["prefill"][0]) / n_prefill if n_prefill else None
        transfer = {}
        for name, (total, count) in after["transfer"].items():
            t0, c0 = before["transfer"].get(name, (0.0, 0.0))
            if count > c0:
                transfer[name] = (total - t0) / (count - c0)
        row = {
            "ok": a.ok,
            "error": a.error,
            "prompt_tokens": a.prompt_tokens,
            "tokens": len(t),
            "ttft_s": a.ttft_s,
            "prefill_s": prefill_s,
            "admit_s": a.ttft_s - prefill_s if a.ttft_s is not None and prefill_s else None,
            "first_gap_s": gaps[0] if gaps else None,
            "itl_s": itl,
            "transfer_est_s": gaps[0] - itl if gaps and itl is not None else None,
            "kv_link_bytes": after["kv_rx"] - before["kv_rx"],
            "worker_transfer_s": transfer,
        }
        return row

    async def latency(self) -> list[dict[str, Any]]:
        o = self.o
        self.s.lab.shape_kv(Shaping())
        warm = await self.one_measured()  # D's first dial of P, UCX wire-up
        self.check("warm-up request through P and D", warm["ok"], warm["error"])
        rows = [_summarize("cold", [warm])]
        for delay in o.delays_ms:
            self.s.lab.shape_kv(Shaping(delay_ms=delay))
            net0 = self.net_counters()
            reqs = [await self.one_measured() for _ in range(o.requests)]
            net = _delta(self.net_counters(), net0)
            good = [r for r in reqs if r["ok"]]
            self.check(
                f"delay {delay:g}ms: {o.requests} requests succeed",
                len(good) == len(reqs),
                [r["error"] for r in reqs if not r["ok"]],
            )
            thin = [
                (r["prompt_tokens"], r["kv_link_bytes"])
                for r in good
                if r["kv_link_bytes"] < (r["prompt_tokens"] or 0) * MIN_KV_BYTES_PER_TOKEN
            ]
            self.check(
                f"delay {delay:g}ms: the KV crossed the P<->D link (not shared memory)",
                not thin,
                {"prompt tokens, bytes over kv0": thin},
            )
            p = await wait_settled(self.http, self.s.p_url, 10)
            d = await wait_settled(self.http, self.s.d_url, 10)
            self.check(f"delay {delay:g}ms: P settled", p["ok"], p)
            self.check(f"delay {delay:g}ms: D settled", d["ok"], d)
            row = _summarize(delay, reqs)
            kv = row["kv_link_bytes"]
            ref = await tcp_reference(self.s, int(kv)) if kv else []
            row.update(tcp_ref_ms=_ms(_p50(ref)), tcp_ref_all_ms=[_ms(t) for t in ref], net=net)
            rows.append(row)
        return rows

    async def cut(self) -> dict[str, Any]:
        o, lab = self.o, self.s.lab
        slow = Shaping(delay_ms=o.cut_delay_ms, rate_mbit=o.cut_rate_mbit)
        lab.shape_kv(slow)
        net0 = self.net_counters()
        rx0 = lab.kv_bytes("decode")[0]
        t0 = time.monotonic()
        tasks = [
            asyncio.create_task(
                chat(
                    self.http,
                    self.s.router_url,
                    self.body(o.cut_prompt_tokens, i % 2 == 0),
                    o.deadline_s + 10,
                )
            )
            for i in range(o.cut_requests)
        ]
        mid = False
        d_load: dict[str, Any] = {}
        while time.monotonic() - t0 < o.prefill_timeout_s and not all(t.done() for t in tasks):
            d_load = health_digest(await get_health(self.http, self.s.d_url))
            moved = lab.kv_bytes("decode")[0] - rx0
            if (d_load.get("inflight_transfers") or 0) >= 1 and moved >= o.cut_after_bytes:
                mid = True
                break
            await asyncio.sleep(0.05)
        at_cut = {
            "after_s": round(time.monotonic() - t0, 2),
            "kv_link_bytes_before_cut": lab.kv_bytes("decode")[0] - rx0,
            "requests_done_before_cut": sum(t.done() for t in tasks),
            "d_load": d_load,
            "p_load": health_digest(await get_health(self.http, self.s.p_url)),
        }
        lab.cut_kv()
        t_cut = time.monotonic()
        rx_cut = lab.kv_bytes("decode")[0]
        self.check("cut while D pulled (mid-transfer)", mid, at_cut)
        answers = list(await asyncio.gather(*tasks))
        t_end = time.monotonic()
        results = []
        for i, a in enumerate(answers):
            in_time = a.elapsed_s <= o.deadline_s
            after_cut = a.elapsed_s - (t_cut - t0)
            results.append(
                {
                    **a.summary(),
                    "clear_error": a.clear_error,
                    "ended_after_cut_s": round(after_cut, 2),
                }
            )
            if after_cut < 0:  # it was not in flight at the cut: nothing to hold it to
                continue
            self.check(
                f"cut request {i} ({'stream' if a.stream else 'JSON'}) failed with a clear "
                f"error within the {o.deadline_s:g}s deadline",
                not a.ok and a.clear_error and in_time,
                {
                    "status": a.status,
                    "kind": a.error_kind,
                    "error": a.error,
                    "elapsed_s": round(a.elapsed_s, 2),
                },
            )
        limit = o.lease_ttl_s + o.settle_slack_s
        remaining = max(1.0, limit - (time.monotonic() - t_cut))
        d = await wait_settled(self.http, self.s.d_url, remaining, since=t_cut)
        remaining = max(1.0, limit - (time.monotonic() - t_cut))
        p = await wait_settled(self.http, self.s.p_url, remaining, since=t_cut)
        self.check(f"D settled within {limit:g}s of the cut (link still cut)", d["ok"], d)
        self.check(
            f"P settled within {limit:g}s of the cut (lease TTL {o.lease_ttl_s:g}s)", p["ok"], p
        )
        partition = await self.partition() if o.partition_requests else None
        bytes_while_cut = lab.kv_bytes("decode")[0] - rx_cut
        net = _delta(self.net_counters(), net0)
        lab.restore_kv()
        lab.shape_kv(Shaping())
        t_restore = time.monotonic()
        post = [
            await chat(
                self.http,
                self.s.router_url,
                self.body(o.prompt_tokens, i % 2 == 0),
                o.deadline_s + 10,
            )
            for i in range(o.post_requests)
        ]
        self.check(
            f"{o.post_requests} requests after the restore succeed",
            all(a.ok for a in post),
            [a.error for a in post if not a.ok],
        )
        p2 = await wait_settled(self.http, self.s.p_url, 10)
        d2 = await wait_settled(self.http, self.s.d_url, 10)
        self.check("P settled after the restore", p2["ok"], p2)
        self.check("D settled after the restore", d2["ok"], d2)
        return {
            "link": slow.describe(),
            "deadline_s": o.deadline_s,
            "at_cut": at_cut,
            "requests": results,
            "all_ended_after_cut_s": round(t_end - t_cut, 2),
            "kv_link_bytes_while_cut": bytes_while_cut,
            "net": net,
            "d_settle": d,
            "p_settle": p,
            "partition": partition,
            "post_restore": [
                {
                    "ok": a.ok,
                    "stream": a.stream,
                    "ttft_s": a.ttft_s,
                    "error": a.error,
                    "after_restore_s": round(a.elapsed_s, 2),
                }
                for a in post
            ],
            "restore_to_post_done_s": round(time.monotonic() - t_restore, 2),
            "p_after": p2,
            "d_after": d2,
        }

    async def partition(self) -> dict[str, Any]:
        """New requests while the link is still cut: P prefills and pins, D cannot reach P's
        channel. They must fail clearly in time, and P's pins (no D ever attached) must go
        within a lease TTL."""
        o = self.o
        t0 = time.monotonic()
        answers = await asyncio.gather(
            *(
                chat(
                    self.http,
                    self.s.router_url,
                    self.body(o.prompt_tokens, i % 2 == 0),
                    o.deadline_s + 10,
                )
                for i in range(o.partition_requests)
            )
        )
        t_end = time.monotonic()
        for i, a in enumerate(answers):
            self.check(
                f"partition request {i} ({'stream' if a.stream else 'JSON'}) failed with a clear "
                f"error within the {o.deadline_s:g}s deadline",
                not a.ok and a.clear_error and a.elapsed_s <= o.deadline_s,
                {
                    "status": a.status,
                    "kind": a.error_kind,
                    "error": a.error,
                    "elapsed_s": round(a.elapsed_s, 2),
                },
            )
        limit = o.lease_ttl_s + o.settle_slack_s
        d = await wait_settled(self.http, self.s.d_url, limit, since=t_end)
        p = await wait_settled(
            self.http, self.s.p_url, max(1.0, limit - (time.monotonic() - t_end)), since=t_end
        )
        self.check(f"partition: D settled within {limit:g}s of the last answer", d["ok"], d)
        self.check(f"partition: P settled within {limit:g}s of the last answer", p["ok"], p)
        return {
            "requests": [a.summary() for a in answers],
            "all_ended_s": round(t_end - t0, 2),
            "d_settle": d,
            "p_settle": p,
        }


async def _scenario(stack: Stack, o: Options) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.monotonic()
        await wait_ready(http, stack, o.startup_timeout_s)
        startup = time.monotonic() - t0
        sc = Scenario(stack, o, http)
        latency = await sc.latency()
        cut = await sc.cut() if o.cut_requests else None
        return {
            "startup_s": round(startup, 1),
            "latency": latency,
            "cut": cut,
            "checks": sc.checks,
            "passed": all(c["ok"] for c in sc.checks),
        }


def run_scenario(o: Options, say: Any = None) -> dict[str, Any]:
    """The whole scenario in a fresh lab (deleted afterwards, also on errors and Ctrl-C)."""
    lab = Lab(kv_link=o.kv_link, mtu=o.mtu, workdir=o.workdir, log=say)
    t0 = time.monotonic()
    with lab:
        stack = start_stack(lab, o)
        try:
            report = asyncio.run(_scenario(stack, o))
        except LabError as e:
            report = {"passed": False, "error": str(e), "checks": []}
        plan = lab.plan
        report["topology"] = {
            "namespaces": dict(zip(("router", "prefill", "decode"), plan.namespaces)),
            "node_addrs": {n: plan.node_addr(n) for n in ("router", "prefill", "decode")},
            "kv_link": {
                "kind": lab.link.kind if lab.link else None,
                "why": lab.kv_link_reason,
                "p_d_addrs": plan.kv_addrs,
                "mtu": plan.mtu,
            },
            "worker_env": {k: v for k, v in lab_worker_env("x").items() if k.startswith("UCX_")},
            "urls": {"router": stack.router_url, "prefill": stack.p_url, "decode": stack.d_url},
        }
        report["workdir"] = lab.workdir
        if not report["passed"]:
            report["log_tails"] = {p.name: p.tail(25) for p in stack.procs}
    report["namespaces_left"] = sorted(ns for ns in list_netns() if ns.endswith(f"-{lab.suffix}"))
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["options"] = {k: v for k, v in asdict(o).items()}
    return report


# --------------------------------------------------------------------------- report


LATENCY_COLUMNS = (  # header, width, key
    ("delay ms", 9, "delay_ms"),
    ("ok", 5, "ok"),
    ("prompt", 7, "prompt_tokens"),
    ("ttft", 8, "ttft_ms"),
    ("prefill", 8, "prefill_ms"),
    ("admit", 7, "admit_ms"),
    ("gap1", 8, "first_gap_ms"),
    ("itl", 6, "itl_ms"),
    ("xfer p50", 9, "transfer_est_ms"),
    ("xfer max", 9, "transfer_max_ms"),
    ("tcp ref", 8, "tcp_ref_ms"),
    ("KV MB", 7, "kv_link_bytes"),
    ("MB/s", 7, "transfer_mb_s"),
)


def format_report(r: dict[str, Any]) -> str:
    out = []
    topo = r.get("topology", {})
    if topo:
        kv = topo["kv_link"]
        out.append(
            f"namespaces {', '.join(topo['namespaces'].values())}; nodes "
            f"{topo['node_addrs']}; KV link {kv['kind']} {kv['p_d_addrs'][0]} <-> "
            f"{kv['p_d_addrs'][1]} ({kv['why']}); {topo['worker_env']}"
        )
    if "error" in r:
        out.append(f"ERROR: {r['error']}")
    lat = r.get("latency") or []
    if lat:
        out.append(
            "\nlatency: delay added to each direction of the P<->D link (RTT + 2x); p50 over "
            f"{r['options']['requests']} streamed requests (cold: the first request, at 0 ms)"
        )
        out.append("".join(h.rjust(w) for h, w, _ in LATENCY_COLUMNS))
        for row in lat:
            cells = []
            for _, width, key in LATENCY_COLUMNS:
                v = row.get(key)
                if key == "ok":
                    v = f"{row['ok']}/{row['n']}"
                elif key == "kv_link_bytes" and v is not None:
                    v = round(v / 1e6, 2)
                elif isinstance(v, float):
                    v = f"{v:g}"
                cells.append(("-" if v is None else str(v)).rjust(width))
            out.append("".join(cells))
        out.append(
            "  ttft: at the client; prefill: P's answer (router); admit: ttft - prefill (router"
            " -> D, D's first lease renewal with P: one P-D round trip); gap1: token 0 -> 1 (D"
            " pulls the KV); xfer: gap1 - median later gap (itl); tcp ref: plain TCP moving as"
            " many bytes P -> D on the same link"
        )
        worker = {k: v for row in lat for k, v in (row.get("worker_transfer_ms") or {}).items()}
        if not worker:
            out.append("  (no worker exports a KV transfer histogram: *kv_transfer*seconds)")
        for row in lat:
            if row.get("worker_transfer_ms"):
                out.append(
                    f"  worker transfer p50 ms at {row['delay_ms']}: {row['worker_transfer_ms']}"
                )
            if row.get("net"):
                out.append(f"  network counters during {row['delay_ms']} ms: {row['net']}")
    cut = r.get("cut")
    if cut:
        out.append(
            f"\ncut: link {cut['link']}; cut {cut['at_cut']['after_s']}s after the start, "
            f"{cut['at_cut']['kv_link_bytes_before_cut']} bytes moved, D "
            f"{cut['at_cut']['d_load']}"
        )
        for i, a in enumerate(cut["requests"]):
            out.append(
                f"  request {i} ({'stream' if a['stream'] else 'JSON'}): "
                f"{'ok' if a['ok'] else a['error_kind']} status {a['status']} after "
                f"{a['elapsed_s']:.2f}s ({a['ended_after_cut_s']}s after the cut), "
                f"tokens {len(a['token_times_s'])}: {a['error']}"
            )
        out.append(f"  bytes over the cut link while cut: {cut['kv_link_bytes_while_cut']}")
        out.append(f"  network counters from the slow-down to the restore: {cut['net']}")
        for side in ("d_settle", "p_settle"):
            s = cut[side]
            out.append(
                f"  {side[0].upper()} settled: {s['ok']} {s['seconds']}s after the cut; "
                f"{s['health']}"
            )
        part = cut.get("partition")
        if part:
            out.append(
                f"  partition (new requests while cut), all ended in {part['all_ended_s']}s:"
            )
            for i, a in enumerate(part["requests"]):
                out.append(
                    f"    request {i} ({'stream' if a['stream'] else 'JSON'}): "
                    f"{'ok' if a['ok'] else a['error_kind']} status {a['status']} after "
                    f"{a['elapsed_s']:.2f}s: {a['error']}"
                )
            for side in ("d_settle", "p_settle"):
                st = part[side]
                out.append(
                    f"    {side[0].upper()} settled: {st['ok']} {st['seconds']}s after the last "
                    f"answer; {st['health']}"
                )
        out.append(
            f"  after the restore: {[('ok' if a['ok'] else a['error']) for a in cut['post_restore']]}"
            f" in {cut['restore_to_post_done_s']}s; P {cut['p_after']['ok']}, "
            f"D {cut['d_after']['ok']}"
        )
    out.append("\nchecks:")
    for c in r.get("checks", []):
        line = f"  [{'ok' if c['ok'] else 'FAIL'}] {c['check']}"
        if not c["ok"]:
            line += f": {c['detail']}"
        out.append(line)
    out.append(
        f"\n{'PASSED' if r.get('passed') else 'FAILED'} in {r.get('wall_s')}s; "
        f"logs in {r.get('workdir')}; namespaces left: {r.get('namespaces_left')}"
    )
    for name, tail in (r.get("log_tails") or {}).items():
        out.append(f"\n--- {name} log (tail) ---\n{tail}")
    return "\n".join(out)


# ---------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Options()
    p.add_argument("--json", action="store_true", help="print the report as one JSON document")
    p.add_argument(
        "--delays",
        default=",".join(f"{x:g}" for x in d.delays_ms),
        help="one-way delays (ms) added to each direction of the P<->D link",
    )
    for name, kind, help_text in (
        ("requests", int, "measured requests per delay"),
        ("prompt_tokens", int, "prompt length (about) of the measured requests"),
        ("max_tokens", int, "tokens per answer"),
        ("cut_requests", int, "requests in flight when the link is cut"),
        ("cut_prompt_tokens", int, "prompt length (about) of those"),
        ("cut_rate_mbit", float, "rate of the P<->D link before the cut"),
        ("cut_delay_ms", float, "one-way delay of the P<->D link before the cut"),
        ("cut_after_bytes", int, "bytes D must have received over the link before the cut"),
        ("partition_requests", int, "requests sent while the link is still cut (0: none)"),
        ("post_requests", int, "requests that must succeed after the restore"),
        ("lease_ttl_s", float, "P's --lease-ttl-s"),
        ("prefill_timeout_s", float, "the router's --prefill-timeout"),
        ("read_timeout_s", float, "the router's --read-timeout"),
        ("settle_slack_s", float, "beyond the lease TTL, how long P and D may take to settle"),
        ("kv_pages", int, "--kv-pages of each worker"),
        ("threads", int, "--threads of each worker"),
        ("mtu", int, "MTU of the P<->D link"),
    ):
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=getattr(d, name),
            help=f"{help_text} (default %(default)s)",
        )
    p.add_argument("--dtype", default=d.dtype, help="--dtype of the workers")
    p.add_argument(
        "--kv-link",
        choices=KV_LINKS,
        default=d.kv_link,
        help="netem (tc) or the userspace wire; auto: netem where the kernel has it",
    )
    p.add_argument("--workdir", default=None, help="where the logs go (default: a temp dir)")


def options_from_args(args: argparse.Namespace) -> Options:
    fields_ = {k: v for k, v in vars(args).items() if k in Options.__dataclass_fields__}
    delays = tuple(float(x) for x in str(args.delays).split(",") if x.strip())
    return Options(delays_ms=delays, **fields_)


def run(args: argparse.Namespace) -> int:
    why = prerequisites()
    if why is None:
        from pd.transfer import nixl_available

        if not nixl_available():
            why = "no NIXL package imports (the KV pull needs one)"
    if why:
        print(f"pd-bench multihost: {why}", file=sys.stderr)
        return 2
    try:
        o = options_from_args(args)
    except ValueError as e:
        print(f"pd-bench multihost: {e}", file=sys.stderr)
        return 2

    def on_term(*_: object) -> None:
        raise KeyboardInterrupt  # unwinds through the lab's cleanup

    signal.signal(signal.SIGTERM, on_term)
    report = run_scenario(o)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report))
    return 0 if report.get("passed") else 1
