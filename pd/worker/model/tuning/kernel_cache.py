"""Where `--dtype auto` / `--quantization auto` keep what they measured (kernel_choice.py): one
JSON file per key under `$PD_CACHE_DIR/kernels/` (default `~/.cache/pd/kernels/`). The key is
everything the measurement depends on (`cache_key`): the search's input (search_input.py:
the flags, sizes and checkpoint), the CPU (model name, every flag, the caps) and torch's version,
so a choice never follows a worker to another machine or model. A file that cannot be read or parsed is a miss (the search runs again and rewrites it). Workers that
start together on one machine search once (`locked`): the first to take a key's lock measures,
the others wait for it and read what it stored."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pd.worker.model.tuning.cpu_info import CpuInfo
from pd.worker.model.tuning.search_input import SearchInput

log = logging.getLogger(__name__)

# The search's version: a change to what it measures or how it decides bumps it (2: splits;
# 3: the smallest batch drops nothing; 4: the LM head measured on its own; 5: onednn-fp32;
# 6: candidates timed side by side in rounds, nothing dropped under 32 rows; 7: smooth-int8,
# the plain dynamic int8 layers out where it runs, a compiled one-row step counted; 8: single
# formats that compute a row the same in every batch, the same batches for every role, no
# one-row compile credit; 9: the answer judge; 10: int4-fp32, the faithful tie; 11: int4-fp32's
# codes in pairs of inputs and its scales in fp16, a faster kernel to time).
VERSION = 11


def cache_root() -> Path:
    """pd's cache directory: `$PD_CACHE_DIR`, default `~/.cache/pd`."""
    root = os.environ.get("PD_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pd"


def cache_dir() -> Path:
    return cache_root() / "kernels"


def cache_key(inp: SearchInput, cpu: CpuInfo) -> dict[str, Any]:
    """The key of `inp`'s choice on `cpu` (as capped), as a JSON-able dict: every field of the
    input, the CPU's model, flags and caps, torch's version and the search's."""
    return {
        "version": VERSION,
        **dataclasses.asdict(inp),
        "cpu_model": cpu.model,
        "cpu_flags": sorted(cpu.flags),
        "isa_limits": dict(cpu.limits),
        "torch": torch.__version__,
    }


def _path(key: dict[str, Any], root: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return root / f"{digest}.json"


def load(key: dict[str, Any], root: Path | None = None) -> dict[str, Any] | None:
    """The stored choice for `key`, or None."""
    path = _path(key, root or cache_dir())
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key:
        return None
    choice = stored.get("choice")
    return choice if isinstance(choice, dict) else None


def store(key: dict[str, Any], choice: dict[str, Any], root: Path | None = None) -> Path | None:
    """Write the choice (atomically: a worker starting beside reads all or nothing); None and a
    warning when the directory cannot be written (the choice is then measured at each start)."""
    path = _path(key, root or cache_dir())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "choice": choice}, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        log.warning("kernel choice not cached (%s): it is measured again at the next start", e)
        return None
    return path


@contextlib.contextmanager
def locked(key: dict[str, Any], root: Path | None = None) -> Iterator[None]:
    """Hold `key`'s lock (a `flock` on a file beside its choice, released by the OS if the
    holder dies): a second worker measuring the same key waits here for the first's result.
    Without a writable directory, no lock (each worker measures)."""
    path = _path(key, root or cache_dir()).with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log.warning("kernel search not locked (%s): workers beside measure on their own", e)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another worker on this machine is choosing kernels: waiting for its choice")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
