"""A three-host lab on one Linux machine: router, prefill (P) and decode (D) workers each in a
network namespace of their own, joined by point-to-point links, for `pd-bench multihost`.

Topology (`SUFFIX`: random hex; `10.N.0.0/16`: a private range picked unused on this host):

```
                 root namespace: the client (pytest, pd-bench)
                  pdh-SUFFIX 10.N.1.1
                        |
                  up0 10.N.1.2
        pdR-SUFFIX: router, node address 10.N.0.1, forwards root <-> P/D
           p0 10.N.2.1                          d0 10.N.3.1
               |                                    |
           r0 10.N.2.2                          r0 10.N.3.2
        pdP-SUFFIX: prefill                  pdD-SUFFIX: decode
        node address 10.N.0.2                node address 10.N.0.3
           kv0 10.N.4.1  <==== KV link ====>  kv0 10.N.4.2
```

Each namespace's *node address* is a /32 on its loopback; a worker binds its HTTP server and
(P) its KV bootstrap channel there (the worker has one `--host` for both). Routes are /32s per
node over the direct link, and no namespace has a default route: the router reaches P and D over
`p0`/`d0`, P and D reach each other only over `kv0` (the ZMQ bootstrap channel), and a cut `kv0`
cannot be bypassed through R. NIXL's UCX traffic is kept on `kv0` with `UCX_TLS=tcp` (across
namespaces UCX could otherwise still pick shared memory or CMA: one host, one IPC namespace) and
`UCX_NET_DEVICES=kv0` (`worker_env`). The root namespace reaches R's node address, and P's and
D's through R (for their /health and /metrics), over `pdh-SUFFIX`. IPv6 is off in the lab's
namespaces, so nothing but the workers' own traffic crosses `kv0`.

The KV link is shaped (delay, rate, loss) and cut in one of two ways:

- `netem`: a veth pair with `tc qdisc replace dev kv0 root netem ...` on both ends (each
  direction gets the delay: the round trip grows by twice it); a cut is `netem loss 100%`.
- `wire`: for kernels without `sch_netem` (this is checked, `netem_available`): a TAP device in
  each of P and D and a process of ours between them (`python -m pd.bench.netns_lab wire`) that
  moves Ethernet frames with the same delay, rate (a byte-limited tail-drop queue) and loss per
  direction; a cut drops every frame, queued ones included.

`Lab` always deletes what it made (namespaces, and with them every veth and route; its
processes, the wire's included), on errors and on Ctrl-C too. The `*_cmd` functions and
`LabPlan` only build `ip`/`tc` command lines: they are testable without root.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import json
import os
import queue
import random
import secrets
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

NODES = ("router", "prefill", "decode")
KV_DEV = "kv0"  # the P<->D link's device, in both P and D
ROOT_PEER_DEV = "up0"  # R's end of the root link
NETNS_DIR = "/run/netns"
KV_LINKS = ("auto", "netem", "wire")
NETEM_DELAY_LIMIT = 100_000  # packets
KV_TXQUEUELEN = 10_000  # packets


class LabError(RuntimeError):
    """A lab command failed (its stderr is in the message)."""


# ----------------------------------------------------------------------------- shaping


@dataclass(frozen=True)
class Shaping:
    """What one direction of the KV link does to a packet (both directions get the same)."""

    delay_ms: float = 0.0
    rate_mbit: float = 0.0  # 0: unlimited
    loss_pct: float = 0.0
    limit_bytes: int = 256 * 1024  # queue of a rate-limited link; more is tail-dropped

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.rate_mbit < 0 or not 0 <= self.loss_pct <= 100:
            raise ValueError(f"bad shaping {self}")
        if self.limit_bytes < 1500:
            raise ValueError("limit_bytes must be >= 1500")

    @property
    def is_clear(self) -> bool:
        return self.delay_ms == 0 and self.rate_mbit == 0 and self.loss_pct == 0

    def describe(self) -> str:
        parts = [f"delay {self.delay_ms:g}ms"]
        if self.rate_mbit:
            parts.append(f"rate {self.rate_mbit:g}mbit")
        if self.loss_pct:
            parts.append(f"loss {self.loss_pct:g}%")
        return " ".join(parts)

    def netem_args(self, mtu: int = 1500) -> list[str]:
        """The `netem ...` part of a `tc qdisc` line (netem's limit counts packets)."""
        args = ["netem", "delay", f"{self.delay_ms:g}ms"]
        if self.rate_mbit:
            packets = max(1, self.limit_bytes // max(mtu, 1))
            args += ["rate", f"{self.rate_mbit:g}mbit", "limit", str(packets)]
        else:  # netem's default (1,000 packets) drops under a delay long enough: a delay alone
            args += ["limit", str(NETEM_DELAY_LIMIT)]  # must not (the wire's never does)
        if self.loss_pct:
            args += ["loss", f"{self.loss_pct:g}%"]
        return args

    def to_wire(self) -> dict[str, Any]:
        return {
            "cmd": "set",
            "delay_ms": self.delay_ms,
            "rate_mbit": self.rate_mbit,
            "loss_pct": self.loss_pct,
            "limit_bytes": self.limit_bytes,
        }


# ------------------------------------------------------------------- command builders


def ip_cmd(ns: str | None, *args: str) -> list[str]:
    """`ip [-n NS] ARGS...` (None: the root namespace)."""
    return ["ip", *(("-n", ns) if ns else ()), *args]


def ns_exec_cmd(ns: str, argv: Sequence[str]) -> list[str]:
    """Run `argv` in a namespace: `ip netns exec NS ARGV...`."""
    return ["ip", "netns", "exec", ns, *argv]


def netns_add_cmd(ns: str) -> list[str]:
    return ["ip", "netns", "add", ns]


def netns_delete_cmd(ns: str) -> list[str]:
    return ["ip", "netns", "delete", ns]


def veth_cmd(a_ns: str | None, a_dev: str, b_ns: str | None, b_dev: str) -> list[str]:
    """A veth pair made right in its namespaces (None: root): no name in root but a root end."""
    a_where = ("netns", a_ns) if a_ns else ()
    b_where = ("netns", b_ns) if b_ns else ()
    return ["ip", "link", "add", a_dev, *a_where, "type", "veth", "peer", "name", b_dev, *b_where]


def addr_cmd(ns: str | None, dev: str, cidr: str) -> list[str]:
    return ip_cmd(ns, "addr", "add", cidr, "dev", dev)


def link_up_cmd(ns: str | None, dev: str, mtu: int | None = None) -> list[str]:
    return ip_cmd(ns, "link", "set", "dev", dev, *(("mtu", str(mtu)) if mtu else ()), "up")


def link_down_cmd(ns: str | None, dev: str) -> list[str]:
    return ip_cmd(ns, "link", "set", "dev", dev, "down")


def route_cmd(ns: str | None, dest: str, via: str, dev: str) -> list[str]:
    return ip_cmd(ns, "route", "replace", dest, "via", via, "dev", dev)


def sysctl_cmd(ns: str, key: str, value: str) -> list[str]:
    return ns_exec_cmd(ns, ["sysctl", "-q", "-w", f"{key}={value}"])


def netem_cmd(ns: str, dev: str, shaping: Shaping, mtu: int = 1500) -> list[str]:
    """`ip netns exec NS tc qdisc replace dev DEV root netem ...`."""
    return ns_exec_cmd(ns, ["tc", "qdisc", "replace", "dev", dev, "root", *shaping.netem_args(mtu)])


def qdisc_delete_cmd(ns: str, dev: str) -> list[str]:
    return ns_exec_cmd(ns, ["tc", "qdisc", "delete", "dev", dev, "root"])


def link_stats_cmd(ns: str, dev: str) -> list[str]:
    return ip_cmd(ns, "-s", "-j", "link", "show", "dev", dev)


# ------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class LabPlan:
    """Names and addresses of one lab, and the commands that make it (pure)."""

    suffix: str
    net: int  # the N of 10.N.0.0/16
    mtu: int = 1500  # of the KV link

    def __post_init__(self) -> None:
        if not (1 <= self.net <= 254 and self.suffix.isalnum() and len(self.suffix) <= 8):
            raise ValueError(f"bad lab plan {self.suffix!r} 10.{self.net}")

    # names
    def ns(self, node: str) -> str:
        return {"router": "pdR-", "prefill": "pdP-", "decode": "pdD-"}[node] + self.suffix

    @property
    def namespaces(self) -> list[str]:
        return [self.ns(n) for n in NODES]

    @property
    def root_dev(self) -> str:
        return f"pdh-{self.suffix}"  # the root namespace's end of the link to R

    # addresses
    def addr(self, link: int, host: int) -> str:
        return f"10.{self.net}.{link}.{host}"

    def node_addr(self, node: str) -> str:
        """Where a node's servers listen (a /32 on its loopback)."""
        return self.addr(0, NODES.index(node) + 1)

    @property
    def root_addr(self) -> str:
        return self.addr(1, 1)

    @property
    def kv_addrs(self) -> tuple[str, str]:
        """(P's, D's) address on the KV link."""
        return self.addr(4, 1), self.addr(4, 2)

    def url(self, node: str, port: int) -> str:
        return f"http://{self.node_addr(node)}:{port}"

    # commands
    def setup_commands(self) -> list[list[str]]:
        """Namespaces, node addresses, the root, R-P and R-D links and their routes (the KV
        link comes after: `kv_veth_command`, then `kv_link_commands`)."""
        r, p, d = self.namespaces
        a = self.addr
        cmds = [netns_add_cmd(ns) for ns in self.namespaces]
        for node, ns in zip(NODES, self.namespaces):
            cmds.append(sysctl_cmd(ns, "net.ipv6.conf.all.disable_ipv6", "1"))
            cmds.append(sysctl_cmd(ns, "net.ipv6.conf.default.disable_ipv6", "1"))
            cmds.append(addr_cmd(ns, "lo", f"{self.node_addr(node)}/32"))
            cmds.append(link_up_cmd(ns, "lo"))
        cmds.append(sysctl_cmd(r, "net.ipv4.ip_forward", "1"))
        # root <-> R
        cmds += [
            veth_cmd(None, self.root_dev, r, ROOT_PEER_DEV),
            addr_cmd(None, self.root_dev, f"{a(1, 1)}/24"),
            addr_cmd(r, ROOT_PEER_DEV, f"{a(1, 2)}/24"),
            link_up_cmd(None, self.root_dev),
            link_up_cmd(r, ROOT_PEER_DEV),
            route_cmd(None, f"10.{self.net}.0.0/24", a(1, 2), self.root_dev),
        ]
        # R <-> P (link 2), R <-> D (link 3)
        for link, ns, node, r_dev in ((2, p, "prefill", "p0"), (3, d, "decode", "d0")):
            cmds += [
                veth_cmd(r, r_dev, ns, "r0"),
                addr_cmd(r, r_dev, f"{a(link, 1)}/24"),
                addr_cmd(ns, "r0", f"{a(link, 2)}/24"),
                link_up_cmd(r, r_dev),
                link_up_cmd(ns, "r0"),
                route_cmd(r, f"{self.node_addr(node)}/32", a(link, 2), r_dev),
                route_cmd(ns, f"{self.node_addr('router')}/32", a(link, 1), "r0"),
                route_cmd(ns, f"10.{self.net}.1.0/24", a(link, 1), "r0"),  # replies to root
            ]
        return cmds

    def kv_veth_command(self) -> list[str]:
        return veth_cmd(self.ns("prefill"), KV_DEV, self.ns("decode"), KV_DEV)

    def kv_link_commands(self) -> list[list[str]]:
        """Addresses and routes of the KV link, once `kv0` exists on both sides."""
        p, d = self.ns("prefill"), self.ns("decode")
        p_kv, d_kv = self.kv_addrs
        return [
            addr_cmd(p, KV_DEV, f"{p_kv}/24"),
            addr_cmd(d, KV_DEV, f"{d_kv}/24"),
            # A TAP's queue toward the wire: deep enough that our wire, not the kernel, decides
            # what is dropped (1,000 packets overflowed at 0 ms delay on 2 busy cores).
            ip_cmd(p, "link", "set", "dev", KV_DEV, "txqueuelen", str(KV_TXQUEUELEN)),
            ip_cmd(d, "link", "set", "dev", KV_DEV, "txqueuelen", str(KV_TXQUEUELEN)),
            link_up_cmd(p, KV_DEV, self.mtu),
            link_up_cmd(d, KV_DEV, self.mtu),
            route_cmd(p, f"{self.node_addr('decode')}/32", d_kv, KV_DEV),
            route_cmd(d, f"{self.node_addr('prefill')}/32", p_kv, KV_DEV),
        ]

    def teardown_commands(self) -> list[list[str]]:
        """Deleting a namespace deletes its veths (both ends) and every route through them."""
        return [netns_delete_cmd(ns) for ns in reversed(self.namespaces)]


def worker_env(token: str) -> dict[str, str]:
    """What a worker in the lab needs beyond its flags: NIXL over TCP on the KV link only."""
    return {
        "PD_CLUSTER_TOKEN": token,
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": KV_DEV,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }


# --------------------------------------------------------------------------- running


def _child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment, plus what the child needs to import `pd` from wherever we did."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{path}" if path else root,
        **(extra or {}),
    }


TCP_COUNTERS = ("Tcp:RetransSegs", "TcpExt:TCPTimeouts", "TcpExt:TCPLossProbes",
                "TcpExt:TCPSpuriousRTOs", "TcpExt:TCPRcvQDrop")  # fmt: skip


def parse_tcp_counters(text: str) -> dict[str, int]:
    """`TCP_COUNTERS` from the text of /proc/net/snmp and /proc/net/netstat (header line, then
    values line, per protocol)."""
    out: dict[str, int] = {}
    lines = text.splitlines()
    for head, values in zip(lines, lines[1:]):
        names, nums = head.split(), values.split()
        if not names or names[0] != nums[0] or names[0] not in ("Tcp:", "TcpExt:"):
            continue
        if not nums[1:] or not nums[1].lstrip("-").isdigit():
            continue
        for name, num in zip(names[1:], nums[1:]):
            key = f"{names[0]}{name}"
            if key in TCP_COUNTERS:
                out[key.split(":", 1)[1]] = int(num)
    return out


def run_cmd(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> str:
    """Run one command; its stdout, or LabError with its stderr."""
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise LabError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child before exec: SIGKILL it when the process that started it dies (so a lab
    killed hard leaves no worker behind; `ip netns exec` keeps it across its exec)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def list_netns() -> set[str]:
    out = run_cmd(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def prerequisites() -> str | None:
    """Why a lab cannot run here (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "sysctl"):
        if shutil.which(tool) is None:
            return f"the `{tool}` tool is missing (iproute2/procps)"
    return None


def lab_unavailable() -> str | None:
    """Why no lab can be made here (None: one can): tools, root, a namespace that can really be
    made (containers may lack CAP_NET_ADMIN), and netem or /dev/net/tun for the KV link."""
    why = prerequisites()
    if why:
        return why
    stage, reason = _probe()
    if stage == "netns":
        return f"cannot make a network namespace with a veth: {reason}"
    if stage == "netem" and not os.path.exists("/dev/net/tun"):
        return f"no netem ({reason}) and no /dev/net/tun for the userspace wire"
    return None


def netem_available() -> tuple[bool, str]:
    """Whether this kernel has sch_netem (and why not)."""
    stage, reason = _probe()
    return stage == "ok", reason


def _probe() -> tuple[str, str]:
    """Try a namespace, a veth in it and netem on the veth, in a scratch namespace (deleted):
    ("ok", ""), or the stage that failed ("netns" or "netem") and its error."""
    ns = f"pdprobe-{secrets.token_hex(3)}"
    stage = "netns"
    try:
        run_cmd(netns_add_cmd(ns))
        run_cmd(veth_cmd(ns, "a0", ns, "b0"))
        stage = "netem"
        run_cmd(netem_cmd(ns, "a0", Shaping(delay_ms=1)))
        return "ok", ""
    except LabError as e:
        return stage, str(e)
    finally:
        run_cmd(netns_delete_cmd(ns), check=False)


def _free_net() -> int:
    """An N with nothing of 10.N.0.0/16 in the root namespace's addresses or routes."""
    used = run_cmd(["ip", "-4", "route", "show", "table", "all"], check=False) + run_cmd(
        ["ip", "-4", "addr"], check=False
    )
    for _ in range(100):
        n = random.randint(100, 250)
        if f"10.{n}." not in used:
            return n
    raise LabError("no free 10.N.0.0/16 on this host")


class KVLink(Protocol):
    kind: str

    def shape(self, shaping: Shaping) -> None: ...
    def cut(self) -> None: ...
    def restore(self) -> None: ...
    def close(self) -> None: ...


class NetemLink:
    """The KV link as a veth pair, shaped by netem on both ends."""

    kind = "netem"

    def __init__(self, plan: LabPlan) -> None:
        self.plan = plan
        self.ends = [(plan.ns("prefill"), KV_DEV), (plan.ns("decode"), KV_DEV)]
        self.shaping = Shaping()

    def start(self) -> None:
        run_cmd(self.plan.kv_veth_command())

    def shape(self, shaping: Shaping) -> None:
        for ns, dev in self.ends:
            run_cmd(netem_cmd(ns, dev, shaping, self.plan.mtu))
        self.shaping = shaping

    def cut(self) -> None:
        s = self.shaping
        lost = Shaping(s.delay_ms, s.rate_mbit, 100.0, s.limit_bytes)
        for ns, dev in self.ends:
            run_cmd(netem_cmd(ns, dev, lost, self.plan.mtu))

    def restore(self) -> None:
        self.shape(self.shaping)

    def close(self) -> None:
        pass  # the veth goes with its namespaces


class WireLink:
    """The KV link as two TAP devices and a frame-moving process (`wire` below)."""

    kind = "wire"

    def __init__(self, plan: LabPlan, log_path: str) -> None:
        self.plan = plan
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str] = queue.Queue()

    def start(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "pd.bench.netns_lab",
            "wire",
            "--ns-a",
            self.plan.ns("prefill"),
            "--ns-b",
            self.plan.ns("decode"),
            "--dev",
            KV_DEV,
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=_child_env(),
                preexec_fn=die_with_parent,
            )
        stdout = self.proc.stdout
        assert stdout is not None
        threading.Thread(target=self._read, args=(stdout,), daemon=True).start()
        ready = self._reply(10.0)
        if not ready.get("ready"):
            raise LabError(f"the wire did not start: {ready}")

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            self._lines.put(line)
        self._lines.put("")

    def _reply(self, timeout: float = 5.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise LabError("the wire did not answer") from None
        if not line:
            raise LabError(f"the wire exited (see {self.log_path})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def command(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        if self.proc is None or self.proc.stdin is None:
            raise LabError("the wire is not running")
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def shape(self, shaping: Shaping) -> None:
        self.command(shaping.to_wire())

    def cut(self) -> None:
        self.command({"cmd": "down"})

    def restore(self) -> None:
        self.command({"cmd": "up"})

    def stats(self) -> dict[str, Any]:
        return self.command({"cmd": "stats"})

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: the wire exits, its TAP devices go with it
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(timeout=5)


@dataclass
class LabProcess:
    name: str
    node: str
    proc: subprocess.Popen[bytes]
    log_path: str

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


@dataclass
class Lab:
    """Create with `with Lab() as lab:`; everything it made is gone after the block."""

    kv_link: str = "auto"  # auto | netem | wire
    mtu: int = 1500
    workdir: str | None = None  # logs (default: a new temporary directory, kept)
    suffix: str = field(default_factory=lambda: secrets.token_hex(3))
    net: int | None = None  # the N of 10.N.0.0/16 (default: one unused on this host)
    log: Any = None  # callable(str) for progress lines (default: stderr)
    plan: LabPlan = field(init=False)
    link: KVLink | None = field(init=False, default=None)
    processes: list[LabProcess] = field(init=False, default_factory=list)
    commands: list[list[str]] = field(init=False, default_factory=list)
    _made: list[str] = field(init=False, default_factory=list)
    kv_link_reason: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if self.kv_link not in KV_LINKS:
            raise ValueError(f"kv_link must be one of {KV_LINKS}")
        why = prerequisites()
        if why:
            raise LabError(why)
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix=f"pd-lab-{self.suffix}-")
        os.makedirs(self.workdir, exist_ok=True)
        self.plan = LabPlan(self.suffix, self.net or _free_net(), self.mtu)

    def _say(self, text: str) -> None:
        (self.log or (lambda s: print(s, file=sys.stderr, flush=True)))(f"[lab] {text}")

    def _run(self, argv: Sequence[str]) -> str:
        self.commands.append(list(argv))
        return run_cmd(argv)

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except LabError as e:
            if exc is None:
                raise
            print(f"[lab] {e}", file=sys.stderr)  # the body's own error goes on

    def start(self) -> None:
        kind = self.kv_link
        if kind in ("auto", "netem"):
            ok, reason = netem_available()
            if not ok and kind == "netem":
                raise LabError(f"netem is not available: {reason}")
            kind = "netem" if ok else "wire"
            self.kv_link_reason = "sch_netem works" if ok else f"no netem here: {reason}"
        if kind == "wire" and not os.path.exists("/dev/net/tun"):
            raise LabError("neither netem nor /dev/net/tun (for the wire) is available")
        self._say(
            f"namespaces {', '.join(self.plan.namespaces)}; 10.{self.plan.net}.0.0/16; "
            f"KV link: {kind} ({self.kv_link_reason or 'asked for'})"
        )
        try:
            for argv in self.plan.setup_commands():
                self._run(argv)
                if argv[:3] == ["ip", "netns", "add"]:
                    self._made.append(argv[3])
            assert self.workdir is not None
            link: NetemLink | WireLink
            if kind == "netem":
                link = NetemLink(self.plan)
            else:
                link = WireLink(self.plan, os.path.join(self.workdir, "wire.log"))
            self.link = link
            link.start()
            for argv in self.plan.kv_link_commands():
                self._run(argv)
            link.shape(Shaping())
        except BaseException:
            self.close()
            raise

    # processes
    def spawn(
        self, name: str, node: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> LabProcess:
        assert self.workdir is not None
        log_path = os.path.join(self.workdir, f"{name}.log")
        cmd = ns_exec_cmd(self.plan.ns(node), argv)
        self.commands.append(cmd)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_child_env(env),
                start_new_session=True,  # a Ctrl-C reaches us; we stop them in close()
                preexec_fn=die_with_parent,
            )
        p = LabProcess(name, node, proc, log_path)
        self.processes.append(p)
        return p

    # the KV link
    def shape_kv(self, shaping: Shaping) -> None:
        assert self.link is not None
        self.link.shape(shaping)

    def cut_kv(self) -> None:
        assert self.link is not None
        self.link.cut()

    def restore_kv(self) -> None:
        assert self.link is not None
        self.link.restore()

    def kv_bytes(self, node: str) -> tuple[int, int]:
        """(received, sent) bytes on a node's end of the KV link (kernel counters)."""
        out = run_cmd(link_stats_cmd(self.plan.ns(node), KV_DEV))
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def kv_drops(self, node: str) -> dict[str, int]:
        """Packets a node's kernel dropped on its end of the KV link (queue full, link down)."""
        stats = json.loads(run_cmd(link_stats_cmd(self.plan.ns(node), KV_DEV)))[0]["stats64"]
        return {
            "rx_dropped": int(stats["rx"]["dropped"]),
            "tx_dropped": int(stats["tx"]["dropped"]),
        }

    def tcp_counters(self, node: str) -> dict[str, int]:
        """The namespace's TCP retransmission counters (`/proc/net/snmp`, `/proc/net/netstat`)."""
        text = run_cmd(
            ns_exec_cmd(self.plan.ns(node), ["cat", "/proc/net/snmp", "/proc/net/netstat"])
        )
        return parse_tcp_counters(text)

    # teardown
    def stop_processes(self, grace_s: float = 5.0) -> None:
        for p in self.processes:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            try:
                p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(timeout=10)

    def close(self) -> None:
        """Stop our processes, then delete our namespaces; safe to call twice. Ctrl-C is held
        off meanwhile (a second Ctrl-C must not leave namespaces behind)."""
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            errors = []
            try:
                self.stop_processes()
            except Exception as e:  # noqa: BLE001 - go on deleting
                errors.append(f"stopping processes: {e!r}")
            if self.link is not None:
                try:
                    self.link.close()
                except Exception as e:  # noqa: BLE001
                    errors.append(f"closing the KV link: {e!r}")
            for ns in reversed(self._made):
                r = subprocess.run(netns_delete_cmd(ns), capture_output=True, text=True)
                if r.returncode != 0 and ns in list_netns():
                    errors.append(f"deleting {ns}: {r.stderr.strip()}")
            self._made = []
            root_dev = self.plan.root_dev  # goes with R's end; deleted here if R never had it
            if run_cmd(ip_cmd(None, "link", "show", "dev", root_dev), check=False):
                run_cmd(ip_cmd(None, "link", "delete", "dev", root_dev), check=False)
            left = [ns for ns in list_netns() if ns.endswith(f"-{self.suffix}")]
            if left or errors:
                raise LabError(f"lab cleanup incomplete: left {left}; {'; '.join(errors)}")
        finally:
            if main and old is not None:
                signal.signal(signal.SIGINT, old)


# ------------------------------------------------------------------------------ wire

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def open_tap(ns: str, dev: str) -> int:
    """A TAP device `dev` made in namespace `ns` (gone when the fd closes)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
    try:
        _setns(target)
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            flags = struct.pack("16sH", dev.encode(), IFF_TAP | IFF_NO_PI)
            fcntl.ioctl(fd, TUNSETIFF, flags)
        finally:
            _setns(home)
    finally:
        os.close(home)
        os.close(target)
    return fd


class _Direction:
    """One direction of the wire: FIFO of (due time, frame), a serializer for the rate."""

    def __init__(self, src: int, dst: int) -> None:
        self.src, self.dst = src, dst
        self.queue: deque[tuple[float, bytes]] = deque()
        self.busy_until = 0.0
        self.stats = dict.fromkeys(
            ("frames", "bytes", "dropped_down", "dropped_loss", "dropped_queue", "write_errors"), 0
        )


class Wire:
    """Moves frames between two fds with `Shaping` per direction; `down` drops them all."""

    def __init__(self, fd_a: int, fd_b: int) -> None:
        self.dirs = (_Direction(fd_a, fd_b), _Direction(fd_b, fd_a))
        self.shaping = Shaping()
        self.down = False
        self.rng = random.Random(0)

    def arrive(self, d: _Direction, frame: bytes, now: float) -> None:
        s = self.shaping
        if self.down:
            d.stats["dropped_down"] += 1
            return
        if s.loss_pct and self.rng.random() * 100 < s.loss_pct:
            d.stats["dropped_loss"] += 1
            return
        due = now
        if s.rate_mbit:
            bps = s.rate_mbit * 1e6 / 8
            if max(0.0, d.busy_until - now) * bps + len(frame) > s.limit_bytes:
                d.stats["dropped_queue"] += 1
                return
            d.busy_until = max(now, d.busy_until) + len(frame) / bps
            due = d.busy_until
        due += s.delay_ms / 1000
        if due <= now and not d.queue:
            self._write(d, frame)
        else:
            d.queue.append((due, frame))

    def _write(self, d: _Direction, frame: bytes) -> None:
        try:
            os.write(d.dst, frame)
            d.stats["frames"] += 1
            d.stats["bytes"] += len(frame)
        except OSError:
            d.stats["write_errors"] += 1

    def deliver(self, now: float) -> float | None:
        """Write what is due; the time of the next due frame."""
        nxt = None
        for d in self.dirs:
            while d.queue and d.queue[0][0] <= now:
                self._write(d, d.queue.popleft()[1])
            if d.queue:
                nxt = d.queue[0][0] if nxt is None else min(nxt, d.queue[0][0])
        return nxt

    def control(self, cmd: dict[str, Any]) -> dict[str, Any]:
        what = cmd.get("cmd")
        if what == "set":
            fields_ = {k: cmd[k] for k in ("delay_ms", "rate_mbit", "loss_pct", "limit_bytes")}
            self.shaping = Shaping(**fields_)
            for d in self.dirs:
                d.busy_until = 0.0
        elif what == "down":
            self.down = True
            for d in self.dirs:
                d.stats["dropped_down"] += len(d.queue)
                d.queue.clear()
        elif what == "up":
            self.down = False
        elif what != "stats":
            return {"ok": False, "error": f"unknown command {what!r}"}
        return {
            "ok": True,
            "down": self.down,
            "shaping": self.shaping.describe(),
            "a_to_b": self.dirs[0].stats,
            "b_to_a": self.dirs[1].stats,
        }

    def serve(self, control_fd: int = 0) -> None:
        """Until EOF on `control_fd`: JSON commands in, one JSON line out per command."""
        os.set_blocking(control_fd, False)
        sel = selectors.DefaultSelector()
        for d in self.dirs:
            sel.register(d.src, selectors.EVENT_READ, d)
        sel.register(control_fd, selectors.EVENT_READ, None)
        pending = b""
        nxt: float | None = None
        while True:
            timeout = None if nxt is None else max(0.0, nxt - time.monotonic())
            for key, _ in sel.select(timeout):
                if key.data is None:
                    chunk = os.read(control_fd, 65536)
                    if not chunk:
                        return
                    pending += chunk
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        if line.strip():
                            reply = self.control(json.loads(line))
                            sys.stdout.write(json.dumps(reply) + "\n")
                            sys.stdout.flush()
                    continue
                d = key.data
                for _ in range(256):
                    try:
                        frame = os.read(d.src, 65536)
                    except BlockingIOError:
                        break
                    except OSError as e:
                        if e.errno in (errno.EAGAIN, errno.EINTR):
                            break
                        raise
                    self.arrive(d, frame, time.monotonic())
            nxt = self.deliver(time.monotonic())


def _wire_main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the lab stops us (EOF on stdin)
    fd_a = open_tap(args.ns_a, args.dev)
    fd_b = open_tap(args.ns_b, args.dev)
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    Wire(fd_a, fd_b).serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd.bench.netns_lab")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wire", help="move frames between a TAP device in each of two namespaces")
    w.add_argument("--ns-a", required=True)
    w.add_argument("--ns-b", required=True)
    w.add_argument("--dev", default=KV_DEV)
    args = parser.parse_args(argv)
    return _wire_main(args)


if __name__ == "__main__":
    sys.exit(main())
