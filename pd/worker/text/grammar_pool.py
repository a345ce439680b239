"""The worker's grammar children: every client's constraint compiles in one of them first.

`GrammarPool.check(kind, spec, timeout)` hands the constraint to an idle child
(`grammar_child`: its own process, address space capped, a compile thread of the worker's
grammar stack size) and returns llguidance's grammar text once it compiled there. A constraint
that crashes its child (a native stack overflow, the memory cap) or runs past the deadline (the
child is killed) is a `GrammarError` for that request alone, and a new child takes the dead one's
place, so the next request compiles again. Several children serve at once: one compile that
takes seconds holds one child, never the others' requests. A child outlives a caller that
leaves mid-compile: it finishes, and goes back to the pool.

Children start at the first constraint (Python, llguidance and the tokenizer to load:
docs/EXPERIMENTS.md §16), all of them at once. The deadline runs from when a child takes the
constraint; waiting for a free child is bounded too (`START_GRACE_S` beyond the deadline: then a
503, `GrammarUnavailable`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pd.worker.text.grammar_child import frame, read_frame
from pd.worker.text.grammar_source import GrammarError

log = logging.getLogger("pd.worker")

# A child's import and tokenizer build, with a wide margin over a start (docs/EXPERIMENTS.md §16)
START_TIMEOUT_S = 60.0
START_GRACE_S = 10.0  # beyond the deadline, how long a constraint may wait for a free child
RESPAWN_DELAY_S = 1.0  # after a child that failed to start


class GrammarUnavailable(RuntimeError):
    """No grammar child could take the constraint in time (all busy, or none starts): the
    server's fault, not the request's (a 503)."""


class _Child:
    """One child process; `ask` blocks (it runs on the pool's I/O threads, never the loop)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self._w = proc.stdin
        self._r = proc.stdout

    def ask(self, message: bytes) -> dict[str, Any]:
        """Send a message (a `frame`), read the reply; EOFError when the child died."""
        self._w.write(message)
        self._w.flush()
        reply = read_frame(self._r)
        if not isinstance(reply, dict):
            raise EOFError
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def reap(self) -> int:
        """Kill and wait (blocks briefly); the exit status."""
        self.kill()
        rc = self.proc.wait()
        for f in (self._w, self._r):
            try:
                f.close()
            except OSError:
                pass
        return rc


def _death(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


class GrammarPool:
    """`children` grammar children over one tokenizer; `setup()` gives the tokenizer's message
    (called once, off the loop, at the first start). Talking to a child blocks, on threads of
    the pool's own: a child that hangs or dies is killed or reaped there, and the loop only
    waits on futures."""

    def __init__(
        self,
        setup: Callable[[], dict[str, Any]],
        children: int = 2,
        memory_mb: int = 1024,
        stack_bytes: int = 8 << 20,
    ) -> None:
        self._setup_of = setup
        self._setup: bytes | None = None
        self.size = children
        self.memory_mb = memory_mb
        self.stack_bytes = stack_bytes
        self._io = ThreadPoolExecutor(2 * children + 1, thread_name_prefix="pd-grammar-io")
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        self._live: set[_Child] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closed = False
        self.last_start_error: str | None = None
        self.crashes = 0  # children a constraint crashed (stack, memory)
        self.timeouts = 0  # children killed at a deadline

    @property
    def down(self) -> str | None:
        """Why no child can compile (none alive after a failed start), or None."""
        if self._started and not self._closed and not self._live and self.last_start_error:
            return f"no grammar child runs ({self.last_start_error})"
        return None

    def pids(self) -> list[int]:
        return sorted(c.proc.pid for c in self._live)

    def start(self) -> None:
        """Start the children (once; returns at once)."""
        if not self._started and not self._closed:
            self._started = True
            for _ in range(self.size):
                self._spawn()

    def close(self) -> None:
        """Kill the children (they also die with this process)."""
        self._closed = True
        for c in list(self._live):
            c.kill()
        for t in list(self._tasks):
            t.cancel()
        self._io.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        """`close`, then wait for the children to be reaped."""
        live = list(self._live)
        self.close()
        await asyncio.gather(*(asyncio.to_thread(c.reap) for c in live), return_exceptions=True)

    async def check(self, kind: str, spec: str, timeout: float) -> str:
        """llguidance's grammar for the constraint once it compiled in a child. Raises
        GrammarError (the request's fault) or GrammarUnavailable."""
        if self._closed:
            raise GrammarUnavailable("the worker is stopping")
        self.start()
        loop = asyncio.get_running_loop()
        # A busy child is free within its deadline; a new one starts in about a second.
        wait_until = loop.time() + timeout + START_GRACE_S
        while True:
            try:
                child = await asyncio.wait_for(self._idle.get(), wait_until - loop.time())
            except TimeoutError:
                why = self.last_start_error
                raise GrammarUnavailable(
                    f"no grammar compiler was free within {timeout + START_GRACE_S:g}s"
                    + (f" (the last start failed: {why})" if why else "")
                ) from None
            if child.proc.poll() is None:
                break
            self._replace(child, f"it died while idle ({_death(child.proc.returncode)})")
        msg = frame({"kind": kind, "spec": spec})
        job = self._background(self._ask(child, msg, timeout))
        return await asyncio.shield(job)  # a caller that leaves leaves the child to finish

    async def _ask(self, child: _Child, msg: bytes, timeout: float) -> str:
        loop = asyncio.get_running_loop()
        reply = loop.run_in_executor(self._io, child.ask, msg)
        try:
            answer = await asyncio.wait_for(reply, timeout)
        except TimeoutError:
            self.timeouts += 1
            self._replace(child, "a compile ran past its deadline")
            raise GrammarError(f"it did not compile within {timeout:g}s: simplify it") from None
        except (EOFError, OSError, ValueError):
            rc = await loop.run_in_executor(self._io, child.reap)
            self.crashes += 1
            self._replace(child, f"a compile crashed it ({_death(rc)})")
            raise GrammarError(
                f"compiling it crashed the grammar compiler ({_death(rc)}): it needs more memory "
                f"than {self.memory_mb} MiB or more stack than {self.stack_bytes >> 10} KiB"
            ) from None
        if answer.get("spent"):  # it ran out of memory: its heap may stay near the cap
            self._replace(child, "a compile ran out of memory")
        else:
            self._idle.put_nowait(child)
        if "error" in answer:
            raise GrammarError(str(answer["error"]))
        return str(answer["grammar"])

    # ------------------------------------------------------------------------------ children

    def _background(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved: a caller that left does not log it as lost

        task.add_done_callback(done)
        return task

    def _replace(self, child: _Child, why: str) -> None:
        child.kill()
        self._live.discard(child)
        log.warning("grammar child %d stopped: %s; starting another", child.proc.pid, why)
        if not self._closed:
            self._io.submit(child.reap)
        self._spawn()

    def _spawn(self, delay: float = 0.0) -> None:
        if not self._closed:
            self._background(self._start_child(delay))

    async def _start_child(self, delay: float) -> None:
        await asyncio.sleep(delay)
        loop = asyncio.get_running_loop()
        try:
            if self._setup is None:
                setup = await loop.run_in_executor(self._io, self._setup_of)
                self._setup = self._setup or frame(setup)
            if self._closed:
                return
            # Started from the loop's thread: the child's death signal follows this thread.
            proc = subprocess.Popen(
                [sys.executable, "-m", "pd.worker.text.grammar_child",
                 "--memory-mb", str(self.memory_mb), "--stack-bytes", str(self.stack_bytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - said in the log and in the next 503
            self._start_failed(f"{type(e).__name__} {e}")
            return
        child = _Child(proc)
        self._live.add(child)
        try:
            reply = await asyncio.wait_for(
                loop.run_in_executor(self._io, child.ask, self._setup), START_TIMEOUT_S
            )
            ok = reply.get("ready") is True
        except (TimeoutError, EOFError, OSError, ValueError):
            ok = False
        if not ok:
            self._live.discard(child)
            rc = await loop.run_in_executor(self._io, child.reap)
            self._start_failed(f"the child did not start ({_death(rc)})")
            return
        if self._closed:
            self._live.discard(child)
            await asyncio.to_thread(child.reap)
            return
        self.last_start_error = None
        self._idle.put_nowait(child)

    def _start_failed(self, why: str) -> None:
        self.last_start_error = why
        log.error("a grammar child did not start: %s; trying again", why)
        self._spawn(RESPAWN_DELAY_S)
