"""The GGUF header read straight through gives what gguf.GGUFReader's fields give."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pd.worker.checkpoint.gguf_loader import read_metadata
from pd.worker.checkpoint.gguf_metadata import read_gguf_metadata
from pd.worker.checkpoint.load_utils import CheckpointError


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
