"""Free TCP ports for the processes a benchmark, a demo or a connector starts on this host.

A port is chosen below the kernel's ephemeral range (`ip_local_port_range`) where there is room:
a port the kernel hands out for `bind(0)` lies in the range it also hands every outgoing
connection, and on a busy host (a test suite's clients, say) one of those can take it between
the choice and the server's own bind ("address already in use").
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 10000  # below this: well-known and registered services' ports
_rng = random.SystemRandom()


def ephemeral_low(path: str = EPHEMERAL_RANGE) -> int | None:
    """The first port of the kernel's ephemeral range (None: not known here)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bound(host: str, port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def free_ports(n: int, host: str = "127.0.0.1", *, low: int | None = None) -> list[int]:
    """`n` distinct ports free on `host` now (all held open together while chosen, so none
    repeats), below the ephemeral range where it leaves room (`low`: its first port), else
    the kernel's choice. Another process may still take one before its user binds it."""
    low = ephemeral_low() if low is None else low
    socks: list[socket.socket] = []
    try:
        if low is not None and low - LOWEST >= 1000:
            for _ in range(50 * n):
                if len(socks) == n:
                    break
                s = _bound(host, _rng.randrange(LOWEST, low))
                if s is not None:
                    socks.append(s)
        while len(socks) < n:
            s = _bound(host, 0)
            if s is None:
                raise OSError(f"no port to bind on {host}")
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on `host` now."""
    return free_ports(1, host)[0]
