"""A GGUF file read straight through: its metadata (the key-value header) and its tensors'
descriptions, with their bytes memory-mapped; and the dequantization of those bytes.

`gguf.GGUFReader` maps every field and tensor of the file into numpy views, one per array element
(~50k for a vocabulary), which takes seconds for the default model, and its numpy dequantization
seconds more (docs/EXPERIMENTS.md §10 and §23). This reads the header in a small fraction of that
and gives the same values as `{key: field.contents()}`; Q4_1, Q8_0, F16 and F32 dequantize in
torch over whole tensors, to the bits gguf's numpy code gives (every other type goes through it).
tests/worker/checkpoint/test_gguf_file.py checks both against the gguf package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from pd.worker.checkpoint.load_utils import CheckpointError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32  # of the tensor data, unless general.alignment says otherwise
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


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: `shape` as stored (innermost first, GGUF's order), `data` its
    bytes (uint8, memory-mapped: only what is used is read)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int  # in the file
    n_bytes: int
    data: np.ndarray

    @property
    def rows_cols(self) -> tuple[int, int]:
        """(rows, columns) of a 2-D tensor as torch holds it: GGUF's shape reversed."""
        cols, rows = self.shape
        return rows, cols


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]  # in the file's order
    data: np.ndarray  # the whole file, memory-mapped (uint8)


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """Every metadata key of the GGUF at `path` with its value (strings decoded, arrays as
    lists, numbers as Python numbers), as `GGUFReader` fields' `contents()` give them."""
    with open(path, "rb") as f:
        return _header(f, path)[0]


def read_gguf(path: str) -> GGUFFile:
    """The metadata and the tensors of the GGUF at `path`, the tensors' bytes memory-mapped."""
    with open(path, "rb") as f:
        meta, n_tensors = _header(f, path)
        infos = [_tensor_info(f, path) for _ in range(n_tensors)]
        align = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-f.tell() // align) * align
    # Copy-on-write: writable for torch.from_numpy's sake; nothing here writes to it.
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    tensors: dict[str, GGUFTensor] = {}
    for name, shape, kind, offset in infos:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        n = int(np.prod(shape))
        if n % block:
            raise CheckpointError(f"{path}: tensor {name} of {n} values is not in whole blocks")
        size = n // block * block_bytes
        begin = start + offset
        if begin + size > len(mapped):
            raise CheckpointError(f"{path}: the file ends inside tensor {name}'s data")
        data = mapped[begin : begin + size]
        tensors[name] = GGUFTensor(name, kind, shape, begin, size, data)
    return GGUFFile(meta, tensors, mapped)


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """A tensor's float32 values in torch's shape (GGUF's reversed), a new tensor (never a view
    of the file), to the bits `gguf.quants.dequantize` gives."""
    shape = tuple(reversed(t.shape))
    kind = t.tensor_type
    if kind == GGMLQuantizationType.F32:
        return torch.from_numpy(t.data.view(np.float32).copy()).reshape(shape)
    if kind == GGMLQuantizationType.F16:
        return torch.from_numpy(t.data.view(np.float16).astype(np.float32)).reshape(shape)
    if kind == GGMLQuantizationType.Q8_0:  # per 32: fp16 scale d, 32 int8 q; w = d * q
        blocks = torch.from_numpy(np.asarray(t.data)).reshape(-1, 34)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(shape)
    if kind == GGMLQuantizationType.Q4_1:  # per 32: fp16 d, fp16 m, 16 bytes of nibbles
        blocks = torch.from_numpy(np.asarray(t.data)).reshape(-1, 20)
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        qs = blocks[:, 4:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()  # weight j low, j + 16 high
        return (d * q + m).reshape(shape)
    raw = t.data.reshape(shape[:-1] + (-1,))  # gguf's numpy code: rows of bytes
    return torch.from_numpy(np.asarray(gguf_dequantize(raw, kind), dtype=np.float32).copy())


def _header(f: BinaryIO, path: str) -> tuple[dict[str, Any], int]:
    """The metadata, and how many tensor descriptions follow it."""
    if f.read(4) != _MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file")
    (version,) = struct.unpack("<I", f.read(4))
    if version < 2:
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 or later)")
    n_tensors, count = struct.unpack("<QQ", f.read(16))
    meta: dict[str, Any] = {}
    for _ in range(count):
        key = _string(f)
        (kind,) = struct.unpack("<I", f.read(4))
        meta[key] = _value(f, kind, path)
    return meta, n_tensors


def _tensor_info(f: BinaryIO, path: str) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = _string(f)
    (n_dims,) = struct.unpack("<I", f.read(4))
    shape = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
    kind, offset = struct.unpack("<IQ", f.read(12))
    try:
        return name, tuple(shape), GGMLQuantizationType(kind), offset
    except ValueError:
        raise CheckpointError(f"{path}: tensor {name} has an unknown GGML type {kind}") from None


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
