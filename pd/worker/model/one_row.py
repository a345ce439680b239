"""The one-row decode step, compiled in the background (`--background-compile`, on by default for
a CPU worker that decodes with the kernels its machine chose).

A single stream's decode step is mostly the cost of ~500 small eager ops between the linear
layers (docs/EXPERIMENTS.md §8); `torch.compile` fuses them. Compiling takes minutes on a cold
inductor cache (far too long to wait for at start-up, as `--compile` does) and seconds on a warm
one, so here the worker serves eagerly from the start while a thread of its own compiles the
step for one row on scratch pages (`compile_one_row`), times it against the same layers eager,
in turns, and installs it (`LlamaModel.compiled_one_row`) only when it is faster. Batches of
more than one row stay eager (compiling them too gained 1.06-1.25x for minutes more of warm-up:
compiled_decode.py).

The inductor cache lives under pd's cache directory (`$PD_CACHE_DIR/inductor`, unless
`TORCHINDUCTOR_CACHE_DIR` says otherwise), beside the kernel search's: once per machine, model
and kernel choice.

While it compiles, the serving thread shares the interpreter with tracing: Python's switch
interval is lowered meanwhile, so that each eager op waits less for the lock.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from pd.worker.model import kernel_cache
from pd.worker.model.attention import AttentionBackend
from pd.worker.model.attention.torch_backend import TorchAttentionBackend
from pd.worker.model.compiled_decode import compile_one_row, layers_inputs
from pd.worker.model.llama import LlamaModel

log = logging.getLogger(__name__)

SCRATCH_PAGES = 3  # the warm-up's and the timing's K/V: pages past the allocator's
TIMING_TURNS = 15  # eager against compiled, in turns (medians)
SWITCH_INTERVAL_S = 0.00005  # while compiling (Python's default: 0.005)
COMPILABLE = ("none", "int8", "int4")  # the one-row formats torch.compile has been run on


def one_row_format(quantization: str) -> str:
    """The format a one-row step runs: SMALL of a split SMALL@ROWS+LARGE, else itself."""
    return quantization.split("@", 1)[0]


def wanted(setting: str, *, device: str, role: str, how: str, quantization: str) -> str | None:
    """Why the worker compiles its one-row step in the background, or None when it does not.
    `auto`: a CPU worker that decodes (role decode or both), on the kernels the machine chose
    (`how` is the kernel choice's: measured or from the cache), in a format it compiles."""
    if setting == "off":
        return None
    fmt = one_row_format(quantization)
    if setting == "on":
        if device != "cpu" or fmt not in COMPILABLE:
            raise ValueError(
                f"--background-compile on runs on CPU with one-row weights in {', '.join(COMPILABLE)}"
                f" (this worker: {device}, {quantization})"
            )
        return "--background-compile on"
    if device != "cpu" or role == "prefill" or how not in ("measured", "cache"):
        return None
    if fmt not in COMPILABLE:
        return None
    return "auto: a CPU worker that decodes on the kernels its machine chose"


def use_pd_inductor_cache() -> str:
    """Point inductor's cache under pd's cache directory (unless the user pointed it)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        path = kernel_cache.cache_root() / "inductor"
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


class BackgroundCompile:
    """Compiles `model`'s one-row step on a thread of its own and installs it when faster."""

    def __init__(
        self, model: LlamaModel, page_size: int, scratch: range, threads: int, why: str
    ) -> None:
        self.model, self.page_size, self.scratch, self.threads = model, page_size, scratch, threads
        self.why = why
        self.state = "compiling"  # then: on (installed), slower (eager kept), failed
        self.figures: dict[str, Any] = {}
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-compile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def as_dict(self) -> dict[str, Any]:
        """/health's `one_row_compile`."""
        return {"state": self.state, "why": self.why, **self.figures}

    def _run(self) -> None:
        torch.set_num_threads(1)  # its eager work is tiny; the graph's loops take `threads`
        interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        start = time.monotonic()
        try:
            cache = use_pd_inductor_cache()
            compiled = compile_one_row(self.model, self.page_size, self.scratch, self.threads)
            took = time.monotonic() - start
            eager_ms, compiled_ms = self._time(compiled)
            self.figures = {
                "compile_s": round(took, 1),
                "eager_ms": round(eager_ms, 2),
                "compiled_ms": round(compiled_ms, 2),
                "inductor_cache": cache,
            }
            self.decide(compiled, eager_ms, compiled_ms)
            log.info(
                "one-row decode step compiled in %.1f s: %.2f ms against %.2f eager (%s)",
                took,
                compiled_ms,
                eager_ms,
                "installed" if self.state == "on" else "slower: eager kept",
            )
        except Exception as e:  # the worker serves on, eagerly
            log.exception("the one-row decode step did not compile: eager steps go on")
            self.state, self.figures = "failed", {"error": f"{type(e).__name__}: {e}"}
        finally:
            sys.setswitchinterval(interval)
            for rank in self.model.ranks:
                rank.kv.buffer[self.scratch.start : self.scratch.stop].zero_()
            self.done.set()

    def decide(
        self, compiled: Callable[..., torch.Tensor], eager_ms: float, compiled_ms: float
    ) -> None:
        """Install the compiled step when it timed faster (never a slow path by accident)."""
        if compiled_ms < eager_ms:
            self.model.compiled_one_row = compiled
            self.state = "on"
        else:
            self.state = "slower"

    def _time(self, compiled: Callable[..., torch.Tensor]) -> tuple[float, float]:
        """Median ms of the layers eager and compiled on the scratch pages, in turns."""
        attns: list[AttentionBackend] = [TorchAttentionBackend() for _ in self.model.ranks]
        args = layers_inputs(self.model, attns, self.scratch, self.page_size)
        runs: dict[str, list[float]] = {"eager": [], "compiled": []}
        arms = (("eager", self.model.layers), ("compiled", compiled))
        with torch.inference_mode():
            for _ in range(TIMING_TURNS + 1):  # the first turn warms up
                for name, fn in arms:
                    t = time.perf_counter()
                    fn(*args)
                    runs[name].append(time.perf_counter() - t)
        return tuple(1000 * statistics.median(r[1:]) for r in runs.values())  # type: ignore[return-value]
