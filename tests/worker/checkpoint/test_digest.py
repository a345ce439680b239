"""The checkpoint digest (what a P/D pair must share): the stored checkpoint's tensors, sampled.

Two checkpoints of one shape with other weights differ; one checkpoint gives one digest whatever
it is loaded as (dtype, Q4_1 kept or not) and however it is sharded; computing it reads a few
bytes of each tensor, never whole tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file

from pd.worker.checkpoint import digest as digest_mod
from pd.worker.checkpoint.digest import WINDOW_BYTES, WINDOWS, checkpoint_digest
from pd.worker.checkpoint.hf_loader import config_from_hf
from pd.worker.checkpoint.load_utils import expected_weight_shapes
from pd.worker.checkpoint.loader import load_checkpoint
from pd.worker.model.config import ModelConfig
from tests.worker.checkpoint.test_loader_units import LLAMA_JSON, tiny_config, write_gguf


def weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in expected_weight_shapes(config).items()}


def gguf_file(tmp_path: Path, name: str, seed: int, quant: str = "F32", **kw) -> str:
    config = tiny_config("llama", **kw)
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, config, weights(config, seed), quant)
    return str(path)


def hf_dir(tmp_path: Path, name: str, seed: int, shards: int = 1) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA_JSON))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, "<unk>"))
    tok.save(str(d / "tokenizer.json"))
    w = weights(config_from_hf(d, LLAMA_JSON), seed)
    names = sorted(w)
    for i in range(shards):
        part = {k: w[k].contiguous() for k in names[i::shards]}
        save_file(part, d / f"model-{i:05d}-of-{shards:05d}.safetensors")
    return str(d)


def test_same_shape_other_weights_give_other_digests(tmp_path: Path) -> None:
    base, tuned = gguf_file(tmp_path, "base", seed=0), gguf_file(tmp_path, "tuned", seed=1)
    a, b = load_checkpoint(base), load_checkpoint(tuned)
    assert a.config.num_layers == b.config.num_layers and a.digest and b.digest
    assert a.digest != b.digest
    # One weight changed (in a sampled window) is enough.
    config = tiny_config("llama")
    w = weights(config, seed=0)
    w["model.layers.1.mlp.down_proj.weight"][0, 0] += 1.0
    write_gguf(tmp_path / "nudged.gguf", config, w, "F32")
    assert checkpoint_digest(str(tmp_path / "nudged.gguf")) != a.digest


def test_digest_is_stable_across_loads_dtypes_and_kept_q4_1(tmp_path: Path) -> None:
    path = gguf_file(tmp_path, "q41", seed=3, quant="Q4_1")
    first = load_checkpoint(path).digest
    assert load_checkpoint(path, dtype=torch.bfloat16).digest == first
    assert load_checkpoint(path, keep_q4_1=True).digest == first  # int4 keeps the blocks
    assert checkpoint_digest(path) == first  # without loading the weights
    # The same weights stored otherwise (another quantization) are another checkpoint.
    assert checkpoint_digest(gguf_file(tmp_path, "q80", seed=3, quant="Q8_0")) != first


def test_hf_digest_is_stable_and_independent_of_sharding(tmp_path: Path) -> None:
    one = hf_dir(tmp_path, "one", seed=5)
    three = hf_dir(tmp_path, "three", seed=5, shards=3)
    other = hf_dir(tmp_path, "other", seed=6)
    d = load_checkpoint(one).digest
    assert d and d == load_checkpoint(one, dtype=torch.bfloat16).digest == checkpoint_digest(one)
    assert checkpoint_digest(three) == d
    assert checkpoint_digest(other) != d


def test_digest_reads_a_few_bytes_per_tensor_not_whole_tensors(tmp_path, monkeypatch) -> None:
    # Tensors of 64 KiB and more: whole-tensor reads would be seen at once.
    path = gguf_file(tmp_path, "big", seed=7, hidden_size=128, head_dim=32, intermediate_size=512)
    hf = hf_dir(tmp_path, "hf", seed=7)
    read: list[int] = []

    def counting(factory):
        def make(*args):
            inner = factory(*args)

            def read_at(offset: int, size: int) -> bytes:
                data = inner(offset, size)
                read.append(len(data))
                return data

            return read_at

        return make

    monkeypatch.setattr(digest_mod, "_mmap_reader", counting(digest_mod._mmap_reader))
    monkeypatch.setattr(digest_mod, "_file_reader", counting(digest_mod._file_reader))
    for ckpt, file_bytes in (
        (path, Path(path).stat().st_size),
        (hf, sum(f.stat().st_size for f in Path(hf).glob("*.safetensors"))),
    ):
        tensors = len(load_checkpoint(ckpt).weights)  # (its load samples them too)
        read.clear()
        checkpoint_digest(ckpt)
        assert read, "the digest reads the tensors through the sampled reader"
        assert max(read) <= WINDOW_BYTES
        assert sum(read) <= tensors * WINDOWS * WINDOW_BYTES
        assert sum(read) < file_bytes / 8, (sum(read), file_bytes)
