"""A GGUF file's metadata (its key-value header) without its tensors: what the tokenizer is built
from when no weights are loaded (`load_tokenizer`, the simulated worker).

`gguf.GGUFReader` maps every field and tensor of the file into numpy views, one per array element
(~50k for a vocabulary): ~3 s for the default model on an idle core, 12 s on a busy one. This
reads the header straight through (~0.1 s) and gives the same values as
`{key: field.contents()}` (tests/worker/checkpoint/test_gguf_metadata.py checks it).
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

import numpy as np

from pd.worker.checkpoint.load_utils import CheckpointError

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF value types of fixed size: struct format (little-endian) and numpy dtype.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """Every metadata key of the GGUF at `path` with its value (strings decoded, arrays as
    lists, numbers as Python numbers), as `GGUFReader` fields' `contents()` give them."""
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file")
        (version,) = struct.unpack("<I", f.read(4))
        if version < 2:
            raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 or later)")
        _tensors, count = struct.unpack("<QQ", f.read(16))
        meta: dict[str, Any] = {}
        for _ in range(count):
            key = _string(f)
            (kind,) = struct.unpack("<I", f.read(4))
            meta[key] = _value(f, kind, path)
        return meta


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, path: str) -> Any:
    if kind == _STRING:
        return _string(f)
    if kind in _SCALARS:
        fmt = _SCALARS[kind][0]
        (v,) = struct.unpack(fmt, f.read(struct.calcsize(fmt)))
        return float(np.float32(v)) if kind == 6 else v
    if kind == _ARRAY:
        item, n = struct.unpack("<IQ", f.read(12))
        if item == _STRING:
            return [_string(f) for _ in range(n)]
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1])
            return np.frombuffer(f.read(n * dtype.itemsize), dtype=dtype).tolist()
        return [_value(f, item, path) for _ in range(n)]  # arrays of arrays
    raise CheckpointError(f"{path}: unknown GGUF value type {kind}")
