"""The CPU a benchmark ran on: model name, the instruction-set flags that decide torch's CPU
kernels, and torch's own view of them (`torch.backends.cpu.get_cpu_capability`)."""

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


@dataclass(frozen=True)
class CpuInfo:
    model: str  # "AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+", ...
    flags: frozenset[str]  # /proc/cpuinfo's flags (x86) or Features (Arm) of the first CPU
    logical_cpus: int
    arch: str  # platform.machine(): "x86_64", "aarch64"
    torch_capability: str  # "AVX2", "AVX512", "DEFAULT", ...

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

    def key_flags(self) -> dict[str, bool]:
        return {f: f in self.flags for f in KEY_FLAGS}

    def describe(self) -> str:
        """One line: `AMD EPYC (x86_64, 2 CPUs; torch: AVX2): avx2 yes, avx512f no, ...`."""
        flags = ", ".join(f"{f} {'yes' if ok else 'no'}" for f, ok in self.key_flags().items())
        return (
            f"{self.model} ({self.arch}, {self.logical_cpus} CPUs, kind {self.kind}; "
            f"torch: {self.torch_capability}): {flags}"
        )

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "arch": self.arch,
            "logical_cpus": self.logical_cpus,
            "kind": self.kind,
            "torch_capability": self.torch_capability,
            "flags": self.key_flags(),
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
    return CpuInfo(
        model=model,
        flags=flags,
        logical_cpus=os.cpu_count() or 1,
        arch=platform.machine(),
        torch_capability=torch.backends.cpu.get_cpu_capability(),
    )
