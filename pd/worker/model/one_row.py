"""The one-row decode step, compiled in the background (`--background-compile on`; off by
default, since the compiled step rounds otherwise than the eager one and a stream alone would then
decode otherwise than among others).

A single stream's decode step is mostly the cost of ~500 small eager ops between the linear
layers (docs/EXPERIMENTS.md §8); `torch.compile` fuses them. Compiling takes minutes on a cold
inductor cache (far too long to wait for at start-up, as `--compile` does) and seconds on a warm
one. So the worker serves eagerly from the start while a thread of its own compiles the step for
one row on scratch pages (`compile_one_row`: its own attention backends, 3 pages past the
allocator's), which fills the cache; then, at a moment when the engine is idle, the torch thread
compiles it again from the warm cache (seconds, docs/EXPERIMENTS.md §9 and §23; a request arriving
then waits), times it against the same layers eager, in turns, and installs it
(`LlamaModel.compiled_one_row`) only when it is faster. A served call whose inputs no graph takes
runs eagerly (never a compile on the serving thread). Batches of more than one row stay eager.

The inductor cache lives under pd's cache directory (`$PD_CACHE_DIR/inductor/<this CPU>`, unless
`TORCHINDUCTOR_CACHE_DIR` says otherwise), beside the kernel search's. While the thread compiles,
the serving thread shares the interpreter with tracing: Python's switch interval is lowered
meanwhile, so that each eager op waits less for the lock. Measured in EXPERIMENTS.md §9.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import torch

from pd.worker.model.attention import AttentionBackend
from pd.worker.model.attention.torch_backend import TorchAttentionBackend
from pd.worker.model.compiled_decode import compile_one_row, layers_inputs
from pd.worker.model.inductor_cache import use_pd_inductor_cache
from pd.worker.model.llama import LlamaModel

log = logging.getLogger(__name__)

SCRATCH_PAGES = 3  # the warm-up's and the timing's K/V: pages past the allocator's
TIMING_TURNS = 15  # eager against compiled, in turns (medians)
IDLE_POLL_S = 0.2
TIMING_ROUNDS = 3  # on the torch thread, TIMING_GAP_S apart (a request may come between)
TIMING_GAP_S = 2.0
SWITCH_INTERVAL_S = 0.00005  # while compiling (Python's default: 0.005)
COMPILABLE = ("none", "int8", "int4")  # the formats torch.compile has been run on (both uses)


def one_row_format(quantization: str) -> str:
    """The format a one-row step runs: SMALL of a split SMALL@ROWS+LARGE, else itself."""
    return quantization.split("@", 1)[0]


def wanted(setting: str, *, device: str, quantization: str) -> str | None:
    """Why the worker compiles its one-row step in the background (`--background-compile on`),
    or None when it does not (off, the default: inductor's fused step rounds otherwise than the
    eager one, so one stream's answer would change once it switches)."""
    if setting == "off":
        return None
    if device != "cpu" or one_row_format(quantization) not in COMPILABLE:
        raise ValueError(
            f"--background-compile on runs on CPU with one-row weights in {', '.join(COMPILABLE)}"
            f" (this worker: {device}, {quantization})"
        )
    return "--background-compile on"


class BackgroundCompile:
    """Compiles `model`'s one-row step on a thread of its own and installs it when faster."""

    def __init__(
        self, model: LlamaModel, page_size: int, scratch: range, threads: int, why: str
    ) -> None:
        self.model, self.page_size, self.scratch, self.threads = model, page_size, scratch, threads
        self.why = why
        # then "waiting for an idle moment", "compiling" again (on the torch thread), and: on
        # (installed), slower (eager kept), failed
        self.state = "compiling"
        self.figures: dict[str, Any] = {}
        self.done = threading.Event()
        # Whether the worker serves nothing now (the engine's `idle`, set once it is built):
        # the final compile waits for it.
        self.idle: Callable[[], bool] | None = None
        self._executor: Executor | None = None
        self.compiled: Callable[..., torch.Tensor] | None = None
        self._thread = threading.Thread(target=self._run, name="pd-compile", daemon=True)

    def start(self, executor: Executor) -> None:
        """Start compiling; the final compile runs on `executor` (the torch thread's)."""
        self._executor = executor
        self._thread.start()

    def as_dict(self) -> dict[str, Any]:
        """/health's `one_row_compile`."""
        return {"state": self.state, "why": self.why, **self.figures}

    def _run(self) -> None:
        start = time.monotonic()
        try:
            cache = use_pd_inductor_cache()
            self._warm_cache()
            warm_s = time.monotonic() - start
            self.state = "waiting for an idle moment"
            while self.idle is None or not self.idle():
                time.sleep(IDLE_POLL_S)
            self.state = "compiling"
            assert self._executor is not None
            compiled, final_s = self._executor.submit(self._final).result()
            eager_ms, compiled_ms = self._time_rounds(compiled)
            self.figures = {
                "compile_s": round(warm_s, 1),
                "final_compile_s": round(final_s, 1),
                "eager_ms": round(eager_ms, 2),
                "compiled_ms": round(compiled_ms, 2),
                "inductor_cache": cache,
            }
            self.decide(compiled, eager_ms, compiled_ms)
            log.info(
                "one-row decode step compiled in %.1f s (%.1f s on the torch thread): %.2f ms "
                "against %.2f eager (%s)",
                warm_s,
                final_s,
                compiled_ms,
                eager_ms,
                "installed" if self.state == "on" else "slower: eager kept",
            )
        except Exception as e:  # the worker serves on, eagerly
            log.exception("the one-row decode step did not compile: eager steps go on")
            self.state, self.figures = "failed", {"error": f"{type(e).__name__}: {e}"}
        finally:
            for rank in self.model.ranks:
                rank.kv.buffer[self.scratch.start : self.scratch.stop].zero_()
            self.done.set()

    def _warm_cache(self) -> None:
        """The long part, on this thread while the torch thread serves: inductor's cache filled
        with the graph the torch thread compiles next (the same options: the graph's loops at
        `threads`). This thread keeps one torch thread: at the serving thread's count, its
        OpenMP team of its own slowed the torch thread's steps, after it too
        (docs/EXPERIMENTS.md §9)."""
        torch.set_num_threads(1)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            compile_one_row(self.model, self.page_size, self.scratch, self.threads)
        finally:
            sys.setswitchinterval(interval)

    def _final(self) -> tuple[Callable[..., torch.Tensor], float]:
        """On the torch thread, between steps, while the engine is idle: the compile again,
        from the warm cache, where it will be served."""
        start = time.monotonic()
        compiled = compile_one_row(self.model, self.page_size, self.scratch, self.threads)
        return compiled, time.monotonic() - start

    def _time_rounds(self, compiled: Callable[..., torch.Tensor]) -> tuple[float, float]:
        """Each arm's best median over a few timing rounds on the torch thread, between
        steps, seconds apart: right after a compile the same layers timed several times slower
        there for a few seconds, and one such round alone once kept eager though the graph was
        the faster (docs/EXPERIMENTS.md §9, "Timing where it serves, in rounds")."""
        assert self._executor is not None
        rounds = []
        for _ in range(TIMING_ROUNDS):
            time.sleep(TIMING_GAP_S)
            rounds.append(self._executor.submit(self._time, compiled).result())
        return min(e for e, _ in rounds), min(c for _, c in rounds)

    def decide(
        self, compiled: Callable[..., torch.Tensor], eager_ms: float, compiled_ms: float
    ) -> None:
        """Install the compiled step when it timed faster (never a slow path by accident)."""
        self.compiled = compiled  # the graph itself (served through `_eager_on_recompile`)
        if compiled_ms < eager_ms:
            self.model.compiled_one_row = _eager_on_recompile(compiled)
            self.state = "on"
        else:
            self.state = "slower"

    def _time(self, compiled: Callable[..., torch.Tensor]) -> tuple[float, float]:
        """Median ms of the layers (`LlamaModel.hidden`; the head runs eagerly after either) eager
        and compiled on the scratch pages, in turns."""
        attns: list[AttentionBackend] = [TorchAttentionBackend() for _ in self.model.ranks]
        runs: dict[str, list[float]] = {"eager": [], "compiled": []}
        arms = (("eager", self.model.hidden), ("compiled", compiled))
        with torch.inference_mode():  # as served: inputs made outside it would recompile
            args = layers_inputs(self.model, attns, self.scratch, self.page_size)
            for _ in range(TIMING_TURNS + 1):  # the first turn warms up
                for name, fn in arms:
                    t = time.perf_counter()
                    fn(*args)
                    runs[name].append(time.perf_counter() - t)
        return tuple(1000 * statistics.median(r[1:]) for r in runs.values())  # type: ignore[return-value]


def _eager_on_recompile(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The compiled step as served: a call whose inputs no compiled graph takes runs eagerly,
    never compiles on the serving thread (seconds of a stalled step)."""

    def step(*args: Any) -> torch.Tensor:
        with torch.compiler.set_stance("eager_on_recompile"):
            return compiled(*args)

    return step
