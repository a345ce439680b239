"""llama.cpp's side of `pd-bench engine --compare-llama-cpp`: llama-cpp-python's OpenAI server on
the same GGUF with the same threads, measured with the same client code as pd's worker.

llama-cpp-python is an optional extra for benchmarking (`pip install 'llama-cpp-python[server]'`,
a build from source of several minutes), never part of set-up or CI: `unavailable()` says why it
cannot run here, and the benchmark reports that instead of a figure. Its build takes the
machine's instruction sets (`system_info()` says which; the JSON has it). On the AMX Xeon of
docs/BENCHMARKS.md the native build (0.3.36) dies at its first decode (a general protection
fault at `ldtilecfg` in ggml's AMX path, even with the tile permission asked for), so it was
built without AMX:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" pip install 'llama-cpp-python[server]'

and, for an AVX2 machine's kernels (beside `scripts/as_avx2.sh`), an AVX2-only build in its own
directory, put first on PYTHONPATH for the run (`-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF`,
`pip install --no-deps --target DIR`).

What is measured, as for pd (engine.py):

- decode at one stream: a streamed completion of `max_tokens` tokens, greedy; the server has no
  `ignore_eos`, so the model's end tokens get a logit bias of -100 (they are never sampled, as
  with pd's `ignore_eos`). Tokens are SSE chunks (one a token in both servers); the rate is the
  chunks after the first over the time from the first to the last.
- prefill: a long prompt, `max_tokens=1`, unstreamed; prompt tokens (the server's `usage`) over
  the request's wall time. Each prompt starts with its own line, so the server's reuse of the
  previous prompt's KV (llama-cpp-python keeps the longest common prefix) reuses nothing.

The server answers one request at a time (and by default a new request interrupts the one
streaming), so only one stream is measured: the issue's targets compare pd's 1 and 32 streams
with llama.cpp's one.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from pd.ports import free_port

INSTALL = "pip install 'llama-cpp-python[server]'"


def unavailable() -> str:
    """Why llama-cpp-python's server cannot run here ("" if it can)."""
    for module in ("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({INSTALL})"
    return ""


def version() -> str:
    from importlib.metadata import version as v

    return v("llama_cpp_python")


def system_info() -> str:
    """The instruction sets its build uses (`CPU : AVX2 = 1 | ...`): a build from source takes
    the machine's unless CMAKE_ARGS said otherwise."""
    import llama_cpp

    info: bytes = llama_cpp.llama_print_system_info()
    return info.decode(errors="replace").strip()


class LlamaCppServer:
    """`python -m llama_cpp.server` on `model` with `threads` threads, started and stopped."""

    def __init__(self, model: str, threads: int, n_ctx: int = 4096) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1",
            "--port", str(self.port), "--n_threads", str(threads), "--n_threads_batch",
            str(threads), "--n_ctx", str(n_ctx), "--interrupt_requests", "False",
        ]  # fmt: skip
        # its log (verbose: the model's metadata, each request's timings) goes to a file, never
        # a pipe nobody reads: a full pipe blocks the server
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self.log, env={**os.environ}
        )

    def log_tail(self, chars: int = 800) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(
                    f"llama_cpp.server exited ({self.proc.returncode}): {err[-800:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama_cpp.server not ready after {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> LlamaCppServer:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def decode_body(eos_ids: frozenset[int]) -> dict:
    """What a llama.cpp stream adds to the common body in place of pd's `ignore_eos`."""
    return {"logit_bias": {str(t): -100.0 for t in sorted(eos_ids)}}
