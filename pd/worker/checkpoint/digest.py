"""The digest of a checkpoint as stored: what a prefill and a decode worker must share (with the
KV format) for D to decode from P's pages (see `KVContract`, pd/worker/disagg/contract.py).

Cheap by design: no file is read whole. Per tensor, in name order: its name, stored dtype (GGML
type or safetensors dtype), shape, byte size, and `WINDOWS` windows of `WINDOW_BYTES` of its
stored bytes spread evenly over it (the first and the last included), all into one SHA-256. A
fine-tune of the same shape changes every sampled window of every tensor it trained, so it never
shares the digest; a change confined to bytes between the windows of every tensor would go
unseen (the price of not hashing gigabytes at each start).

It is taken from the file, before any cast or runtime quantization: the same checkpoint loaded
as float32 or bfloat16, dense or with its Q4_1 blocks kept (int4), has one digest. Safetensors
shards are merged by tensor name, so how a checkpoint is split does not count either.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pd.worker.checkpoint.gguf_file import GGUFFile, read_gguf
from pd.worker.checkpoint.load_utils import CheckpointError

WINDOWS = 16  # sampled windows per tensor
WINDOW_BYTES = 64
_VERSION = b"pd-checkpoint-digest-v1"

ReadAt = Callable[[int, int], bytes]  # (absolute offset, length) -> those bytes of the file


def _mmap_reader(data: np.ndarray) -> ReadAt:
    """Reads of a memory-mapped file: only the pages touched are read."""
    return lambda offset, size: bytes(data[offset : offset + size])


def _file_reader(f: BinaryIO) -> ReadAt:
    def read_at(offset: int, size: int) -> bytes:
        f.seek(offset)
        return f.read(size)

    return read_at


def _windows(start: int, size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the windows sampled from `size` bytes at `start`."""
    if size <= WINDOWS * WINDOW_BYTES:
        for off in range(0, size, WINDOW_BYTES):
            yield start + off, min(WINDOW_BYTES, size - off)
        return
    last = size - WINDOW_BYTES
    for i in range(WINDOWS):
        yield start + last * i // (WINDOWS - 1), WINDOW_BYTES


_Entry = tuple[str, str, tuple[int, ...], int, int, ReadAt]  # name, dtype, shape, offset, size


def _digest(kind: str, entries: Iterable[_Entry]) -> str:
    h = hashlib.sha256(_VERSION + b"\0" + kind.encode())
    for name, dtype, shape, offset, size, read in sorted(entries, key=lambda e: e[0]):
        h.update(json.dumps([name, dtype, list(shape), size]).encode())
        for off, n in _windows(offset, size):
            data = read(off, n)
            if len(data) != n:
                raise CheckpointError(f"tensor {name}: the file ends inside its data")
            h.update(data)
    return f"{kind}:{h.hexdigest()[:32]}"


def gguf_digest(gguf: GGUFFile) -> str:
    """The digest of an opened GGUF file (its tensors as stored, quantized blocks included)."""
    read = _mmap_reader(gguf.data)
    return _digest(
        "gguf",
        (
            # GGUF's shape is innermost first, as stored; it only has to be the same each time.
            (
                t.name,
                t.tensor_type.name,
                tuple(int(n) for n in t.shape),
                int(t.data_offset),
                int(t.n_bytes),
                read,
            )  # fmt: skip
            for t in gguf.tensors.values()
        ),
    )


def safetensors_digest(files: Iterable[Path]) -> str:
    """The digest of a set of safetensors shards, read from their headers and sampled bytes."""
    with ExitStack() as stack:
        entries: list[_Entry] = []
        seen: set[str] = set()
        for path in files:
            f = stack.enter_context(open(path, "rb"))
            try:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            except (struct.error, ValueError) as e:
                raise CheckpointError(f"{path}: not a safetensors file: {e}") from e
            read = _file_reader(f)
            base = 8 + header_len
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in seen:
                    raise CheckpointError(f"{path}: {name} appears in more than one file")
                seen.add(name)
                begin, end = info["data_offsets"]
                entries.append(
                    (name, info["dtype"], tuple(info["shape"]), base + begin, end - begin, read)
                )
        return _digest("safetensors", entries)


def checkpoint_digest(path: str) -> str:
    """The digest of the checkpoint at `path` (a .gguf file or a Hugging Face directory),
    without loading its weights. The loaders compute the same one as they load."""
    p = Path(path)
    if p.is_dir():
        return safetensors_digest(sorted(p.glob("*.safetensors")))
    return gguf_digest(read_gguf(path))
