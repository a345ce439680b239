"""`--quantization int4-fp32`: int4 weights in groups (a GGUF's Q4_1 blocks as they are stored)
multiplied in fp32 by pd's own kernel (`csrc/int4_fp32.c`), which sums every output the same way
whatever the batch.

Why a kernel of our own: torch's CPU int4 kernel (`int4` in quant.py) runs on bf16 activations
and bf16 scales (its only vectorized path), and re-reads the packed weights for every four rows,
so at 32 rows and at a prefill chunk it is slower than dense fp32 (docs/BENCHMARKS.md, the AVX2
cap). This one dequantizes each weight once per pass, `fma(q, scale, low)` (the weights' exact
fp32 dequantization), and each output is one fp32 accumulator over the inputs in order: the
model's own weights, fp32 arithmetic, and one row's bits equal at every batch size, threads
and blocking included (tests/worker/model/test_int4_fp32.py).

The weights are read as stored: 4 bits a weight, the two codes of a pair of inputs in one
byte, so that one widening load gives a block's 16 outputs for two inputs; the scales and lows in
fp16 where they are fp16 values (a GGUF's Q4_1 blocks store them so), else fp32.

The C file is compiled at first use with the machine's C compiler (`$CC`, else `cc`;
`-O3 -fopenmp` and `-mavx2 -mfma -mf16c`, with `-mavx512f` where the CPU has it: one source,
each lane's operations the same in both builds, so the same bits) into `$PD_CACHE_DIR/kernels/`
and loaded with ctypes; its OpenMP is the libgomp torch loaded (one pool), and a call uses
torch's thread count. Where it cannot run (not x86-64 with AVX2, FMA and F16C, no compiler, a
failed build) `int4_fp32_refusal()` says why, and the kernel search leaves it out.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from pd.worker.model.tuning.cpu_info import read_cpu_info
from pd.worker.model.tuning.kernel_cache import cache_dir

INT4_FP32 = "int4-fp32"
BLOCK = 16  # outputs per block (the C file's NB)
CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
# The builds, by the instructions they use: the same lanes' operations, the same bits.
VARIANTS = {
    "avx512": ("-mavx512f", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
}
_ARGTYPES: list[Any] = [
    ctypes.c_void_p,  # x
    ctypes.c_int64,  # M
    ctypes.c_int64,  # K
    ctypes.c_int64,  # N
    ctypes.c_void_p,  # packed q
    ctypes.c_void_p,  # scales
    ctypes.c_void_p,  # lows
    ctypes.c_int,  # half: scales and lows in fp16
    ctypes.c_int64,  # group
    ctypes.c_void_p,  # y
    ctypes.c_int,  # threads
]


def _source() -> str:
    return resources.files("pd.worker.model").joinpath("csrc/int4_fp32.c").read_text()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _build(source: str, compiler: str, flags: tuple[str, ...]) -> Path:
    """The shared library for `source`, compiled once per source and flags (a file named by
    their hash; a worker beside that builds it at the same moment writes its own temporary
    file and renames it: the last rename wins, both are whole)."""
    tag = hashlib.sha256((source + " ".join(flags) + compiler).encode()).hexdigest()[:16]
    out = cache_dir() / f"int4_fp32-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "int4_fp32.c"
        src.write_text(source)
        lib = Path(tmp) / "int4_fp32.so"
        done = subprocess.run(
            [compiler, *flags, "-o", str(lib), str(src)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        partial = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(lib, partial)
        os.replace(partial, out)
    return out


def variant() -> str:
    """The build this CPU runs (as `scripts/as_avx2.sh` caps it: cpu_info's flags)."""
    return "avx512" if "avx512f" in read_cpu_info().flags else "avx2"


@functools.cache
def _library(build: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded kernel, "") or (None, why it cannot run here); `build`: a key of VARIANTS
    (default: this CPU's)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"{INT4_FP32} is an x86-64 kernel (this machine: {platform.machine()})"
    flags = read_cpu_info().flags
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    if missing:
        return None, f"{INT4_FP32} needs {' and '.join(missing)}, which this CPU lacks"
    compiler = _compiler()
    if compiler is None:
        return None, f"{INT4_FP32} is compiled at first use and no C compiler (cc, gcc) is here"
    try:
        path = _build(_source(), compiler, (*CFLAGS, *VARIANTS[build or variant()]))
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:
        return None, f"{INT4_FP32}: its kernel could not be built or loaded ({e})"
    fn = lib.pd_int4_fp32_linear
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return lib, ""


def int4_fp32_refusal() -> str:
    """Why int4-fp32 cannot run on this machine ("" when it can)."""
    return _library()[1]


def exactly_half(t: torch.Tensor) -> bool:
    """Whether every value of `t` is an fp16 value (a GGUF's Q4_1 scales and lows are)."""
    return bool(torch.equal(t.float().half().float(), t.float()))


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(bytes [N/16, K/2, 16], scales and lows [N/16, K/group, 16]) from q [N, K] (0..15) and
    the groups' scale and low [N, K/group]: per block of 16 outputs and per pair of inputs,
    byte j holds output j's code for the first input in its low nibble and for the second in its
    high one (the C file's layout). Scales and lows are fp16 where each is exactly an fp16
    value, else fp32."""
    n, k = q.shape
    if n % BLOCK:
        raise ValueError(f"{INT4_FP32} needs a layer's outputs in blocks of {BLOCK} (got {n})")
    groups = scale.shape[1]
    if k % 2 or (k // groups) % 2:
        raise ValueError(
            f"{INT4_FP32} needs an even input width and group (got {k}, {k // groups})"
        )
    pairs = q.to(torch.uint8).view(n // BLOCK, BLOCK, k // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 1).contiguous()
    dtype = torch.float16 if exactly_half(scale) and exactly_half(low) else torch.float32

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // BLOCK, BLOCK, groups).permute(0, 2, 1).to(dtype).contiguous()

    return packed, per_block(scale), per_block(low)


class Int4Fp32Linear:
    """`y = x @ w.T (+ bias)` with `w = q * scale + low` in groups, in fp32 (the module's note);
    activations of another dtype are converted to fp32 and back."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        low: torch.Tensor,
        bias: torch.Tensor | None,
        build: str | None = None,  # a key of VARIANTS (default: this CPU's)
    ) -> None:
        lib, why = _library(build)
        if lib is None:
            raise ValueError(why)
        self._fn = lib.pd_int4_fp32_linear
        self.out, self.inp = q.shape
        self.group = self.inp // scale.shape[1]
        self.packed, self.scales, self.lows = pack(q, scale, low)
        self.half = int(self.scales.dtype == torch.float16)
        self.bias = bias
        self.nbytes = sum(
            t.numel() * t.element_size()
            for t in (self.packed, self.scales, self.lows, bias)
            if t is not None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32).contiguous()
        m = xf.shape[0]
        y = torch.empty(m, self.out, dtype=torch.float32)
        if m:
            rc = self._fn(xf.data_ptr(), m, self.inp, self.out, self.packed.data_ptr(),
                          self.scales.data_ptr(), self.lows.data_ptr(), self.half, self.group,
                          y.data_ptr(), torch.get_num_threads())  # fmt: skip
            if rc != 0:
                raise MemoryError(f"{INT4_FP32}: no memory for a weight panel")
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias
