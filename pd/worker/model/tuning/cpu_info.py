"""The CPU a benchmark ran on: model name, the instruction-set flags that decide torch's CPU
kernels, and torch's own view of them (`torch.backends.cpu.get_cpu_capability`).

The libraries under torch each take an environment variable that caps the instructions they use
(`ISA_LIMITS`): set to AVX2, the machine runs as an AVX2-only CPU would, as far as kernels go
(`scripts/as_avx2.sh` sets them all). When any of them says AVX2, the flags here drop AVX-512
and AMX (`effective_flags`), so the kernel choice, its cache key and FBGEMM's activation range
follow the capped machine, and the description says so."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

# The flags that pick a kernel family: bf16/int8 dot products (AVX512-BF16, VNNI, AMX) or not.
KEY_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
)


# Each library's cap on its instructions, and the value that means "AVX2 only"
ISA_LIMITS = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorized kernels
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (bf16 and fp32 matmuls, quantized onednn engine)
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",  # FBGEMM (quantized fbgemm engine, fp16 gemm)
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL (fp32 sgemm)
}
ABOVE_AVX2 = ("avx512", "amx", "avx_vnni")  # flag prefixes an AVX2 cap removes


def isa_limits(env: dict[str, str] | None = None) -> dict[str, str]:
    """The caps set in the environment (name -> value)."""
    env = dict(os.environ) if env is None else env
    return {k: env[k] for k in ISA_LIMITS if env.get(k)}


def effective_flags(flags: frozenset[str], limits: dict[str, str]) -> frozenset[str]:
    """`flags` as the kernels see them: without AVX-512, AMX and AVX-VNNI under an AVX2 cap."""
    if any(v.lower() == ISA_LIMITS[k].lower() for k, v in limits.items()):
        return frozenset(f for f in flags if not f.startswith(ABOVE_AVX2))
    return flags


@dataclass(frozen=True)
class CpuInfo:
    model: str  # "AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+", ...
    flags: frozenset[str]  # /proc/cpuinfo's flags (x86) or Features (Arm) of the first CPU
    logical_cpus: int
    arch: str  # platform.machine(): "x86_64", "aarch64"
    torch_capability: str  # "AVX2", "AVX512", "DEFAULT", ...
    limits: tuple[tuple[str, str], ...] = ()  # ISA_LIMITS set in the environment

    @property
    def kind(self) -> str:
        """A short name for the kernels this CPU can run fast: AMX, AVX512-BF16, AVX-512, AVX2."""
        if "amx_bf16" in self.flags:
            return "AMX"
        if "avx512_bf16" in self.flags:
            return "AVX512-BF16"
        if "avx512f" in self.flags:
            return "AVX-512"
        if "avx2" in self.flags:
            return "AVX2"
        return self.arch

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 products run in hardware (AMX, AVX512-BF16, Arm's BF16), not converted."""
        return self.kind in ("AMX", "AVX512-BF16") or (
            self.arch in ("aarch64", "arm64") and "bf16" in self.flags
        )

    def key_flags(self) -> dict[str, bool]:
        return {f: f in self.flags for f in KEY_FLAGS}

    def describe(self) -> str:
        """One line: `AMD EPYC (x86_64, 2 CPUs; torch: AVX2): avx2 yes, avx512f no, ...`."""
        flags = ", ".join(f"{f} {'yes' if ok else 'no'}" for f, ok in self.key_flags().items())
        capped = "; capped by " + ", ".join(f"{k}={v}" for k, v in self.limits)
        return (
            f"{self.model} ({self.arch}, {self.logical_cpus} CPUs, kind {self.kind}; "
            f"torch: {self.torch_capability}{capped if self.limits else ''}): {flags}"
        )

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "arch": self.arch,
            "logical_cpus": self.logical_cpus,
            "kind": self.kind,
            "torch_capability": self.torch_capability,
            "flags": self.key_flags(),
            "limits": dict(self.limits),
        }


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in a /proc/cpuinfo text. x86 names them
    `model name` and `flags`; Arm has `Features` and often no model name."""
    model, flags = "", ""
    for line in text.splitlines():
        if not line.strip():
            if model and flags:
                break  # the first processor's block ended
            continue
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = value
    return model or "unknown CPU", frozenset(flags.split())


@functools.cache
def read_cpu_info() -> CpuInfo:
    """This machine's CPU (read once per process)."""
    try:
        with open("/proc/cpuinfo") as f:
            model, flags = parse_cpuinfo(f.read())
    except OSError:
        model, flags = platform.processor() or "unknown CPU", frozenset()
    limits = isa_limits()
    return CpuInfo(
        model=model,
        flags=effective_flags(flags, limits),
        limits=tuple(sorted(limits.items())),
        logical_cpus=os.cpu_count() or 1,
        arch=platform.machine(),
        torch_capability=torch.backends.cpu.get_cpu_capability(),
    )
