"""The GGUF file read straight through gives what gguf.GGUFReader gives: the header's values,
the tensors' descriptions and bytes, and gguf's numpy dequantization of them, bit for bit."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from pd.worker.checkpoint.gguf_file import dequantize, read_gguf, read_gguf_metadata
from pd.worker.checkpoint.load_utils import CheckpointError


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """The reference: the reader's fields' values, less its own GGUF.* entries."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def assert_same_tensors(path: str, every: bool = True) -> None:
    """Each tensor's description and bytes as the reader gives them, and its dequantized values
    as gguf's numpy code computes them, to the bit (not `every`: the first of each type)."""
    ours = read_gguf(path).tensors
    reader = gguf.GGUFReader(path)
    assert list(ours) == [t.name for t in reader.tensors]
    kinds = set()
    for ref in reader.tensors:
        t = ours[ref.name]
        assert t.tensor_type == ref.tensor_type
        assert t.shape == tuple(int(n) for n in ref.shape)
        assert (t.data_offset, t.n_bytes) == (int(ref.data_offset), int(ref.n_bytes))
        assert t.data.tobytes() == ref.data.tobytes()
        if not every and t.tensor_type in kinds:
            continue
        kinds.add(t.tensor_type)
        want = np.asarray(gguf_dequantize(ref.data, ref.tensor_type), dtype=np.float32)
        got = dequantize(t)
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, ref.name
        assert torch.equal(got, torch.from_numpy(want.copy())), ref.name


def write_gguf(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("t.u32", 7)
    w.add_int32("t.i32", -3)
    w.add_float32("t.f32", 1e-5)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**40)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["a", "Ġb", "<|im_end|>"])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_tensor("x", np.zeros((2, 4), dtype=np.float32))
    values = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    w.add_tensor("f32", values)
    w.add_tensor("f16", values.astype(np.float16))
    # Q4_1 and Q8_0 dequantize in torch; Q5_0 (as every other type) through gguf's code.
    for kind in (Q.Q4_1, Q.Q8_0, Q.Q5_0):
        w.add_tensor(kind.name, quantize(values, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_type_reads_as_the_reader_gives_it(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    ours = read_gguf_metadata(str(path))
    theirs = read_metadata(gguf.GGUFReader(str(path)))
    assert ours == theirs
    assert {k: type(v) for k, v in ours.items()} == {k: type(v) for k, v in theirs.items()}
    assert ours["t.f32"] == float(np.float32(1e-5)) and ours["t.strs"][1] == "Ġb"


def test_every_tensor_reads_and_dequantizes_as_gguf_gives_it(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    assert_same_tensors(str(path))
    assert {t.tensor_type for t in read_gguf(str(path)).tensors.values()} > {Q.Q4_1, Q.Q5_0}


def test_a_file_cut_inside_a_tensor_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    last = list(read_gguf(str(path)).tensors.values())[-1]
    path.write_bytes(path.read_bytes()[: last.data_offset + last.n_bytes - 1])
    with pytest.raises(CheckpointError, match="ends inside tensor"):
        read_gguf(str(path))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(CheckpointError, match="not a GGUF"):
        read_gguf_metadata(str(path))


@pytest.mark.slow
def test_the_default_model_reads_as_the_reader_gives_it():
    from pd.worker.checkpoint import default_model_path

    path = default_model_path()
    assert read_gguf_metadata(path) == read_metadata(gguf.GGUFReader(path))
    assert_same_tensors(path, every=False)
