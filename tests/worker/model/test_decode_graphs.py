"""Decode steps from CUDA graphs (`decode_graphs.py`).

On any machine: the buckets, and a graph step without the capture (`capture=False`: the same
buffers, padding and plans, run eagerly) giving eager's logits and writing eager's K/V, the
padded rows touching nothing but the scratch page; and the runner's `execute` choosing the
graph for the steps that fit it, with eager's tokens. On CUDA: captured graphs replayed against
eager, through the runner's `execute` as a worker runs them (scripts/gpu_check.sh runs these).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pd.kvcache.paged_metadata import build_paged_metadata
from pd.protocol import GenerationOptions
from pd.worker.model.decode_graphs import DecodeGraphs, graph_buckets
from pd.worker.model.runner import ModelRunner
from pd.worker.model.runner_config import Accelerator, RunnerConfig
from tests.model_fixtures import default_checkpoint

PAGE = 16
MAX_LEN = 256  # 16 pages: what the torch backend pads every graph row to
CUDA = torch.cuda.is_available()


def test_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    with pytest.raises(ValueError, match="cuda-graph-max-batch"):
        graph_buckets(0)


def make(device: str, dtype: torch.dtype, num_layers: int | None, pages: int, **kw) -> ModelRunner:
    ckpt = default_checkpoint()
    config = (
        ckpt.config
        if num_layers is None
        else dataclasses.replace(ckpt.config, num_layers=num_layers)
    )
    graphs = kw.pop("cuda_graph_max_batch", 0)
    rc = RunnerConfig(
        tp=1, dtype=dtype, device=device, num_pages=pages, page_size=PAGE, max_model_len=MAX_LEN,
        accelerator=Accelerator("cuda-graphs", max_batch=graphs) if graphs else Accelerator(),
        **kw,
    )  # fmt: skip
    return ModelRunner(config, ckpt.weights, rc)


def prefill(runner: ModelRunner, prompts, pages) -> None:
    for p, ids in zip(pages, prompts):
        meta = build_paged_metadata([(p, 0, len(ids))], PAGE, runner.device)
        ids_t = torch.tensor(ids, device=runner.device)
        runner.model.forward(ids_t, meta, torch.tensor([len(ids) - 1], device=runner.device))


def graph_vs_eager(runner: ModelRunner, graphs: DecodeGraphs, atol: float) -> None:
    """Three sequences of different lengths (bucket 4: one padded row) decode 20 steps through
    the graph and through eager from the same K/V: the same logits and K/V in their pages (to
    rounding: a batch of 4 rows multiplies in another order than one of 3)."""
    prompts = [list(range(1, 20)), list(range(40, 70)), [5, 6, 7]]
    pages = [list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]
    prefill(runner, prompts, pages)
    pool = runner.model.ranks[0].kv
    scratch = graphs.pad_spec[0][0]
    pool.buffer[scratch].zero_()  # the capture's warm-up wrote it: the graph's writes must show
    start = pool.buffer.clone()

    def run(use_graph: bool) -> list[torch.Tensor]:
        pool.buffer.copy_(start)
        out = []
        for i in range(20):  # contexts cross page boundaries
            specs = [(p, len(ids) + i, 1) for p, ids in zip(pages, prompts)]
            tokens = [(7 * i + s) % 500 + 1 for s in range(3)]
            if use_graph:
                padded, ids = graphs.padded(specs, tokens)
                assert len(padded) == 4
                meta = build_paged_metadata(padded, PAGE, runner.device)
                ids_t = torch.tensor(ids, device=runner.device)
                out.append(graphs.run(ids_t, meta)[:3].clone())
            else:
                meta = build_paged_metadata(specs, PAGE, runner.device)
                ids_t = torch.tensor(tokens, device=runner.device)
                rows = torch.arange(3, device=runner.device)
                out.append(runner.model.forward(ids_t, meta, rows))
        return out

    eager = run(False)
    eager_kv = pool.buffer.clone()
    graph = run(True)
    for e, g in zip(eager, graph):
        torch.testing.assert_close(g, e, atol=atol, rtol=atol / 10)
    used = [p for seq in pages for p in seq]
    torch.testing.assert_close(pool.buffer[used], eager_kv[used], atol=atol, rtol=atol / 10)
    # The padded row wrote the scratch page and nothing else.
    others = [p for p in range(pool.num_pages) if p not in used and p != scratch]
    assert others and torch.equal(pool.buffer[others], start[others])
    assert not torch.equal(pool.buffer[scratch], start[scratch])


def test_graph_step_without_capture_equals_eager():
    runner = make("cpu", torch.float32, num_layers=3, pages=16)
    graphs = DecodeGraphs(runner.model, 8, MAX_LEN, scratch_page=15, capture=False)
    graph_vs_eager(runner, graphs, atol=1e-4)
    assert graphs.bucket(9) is None  # above the largest bucket: eager


def test_graphs_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="needs --device cuda and --tp 1"):
        make("cpu", torch.float32, num_layers=1, pages=4, cuda_graph_max_batch=8)
    runner = make("cpu", torch.float32, num_layers=1, pages=4)
    with pytest.raises(ValueError, match="need --device cuda"):
        DecodeGraphs(runner.model, 8, MAX_LEN, scratch_page=3, capture=True)
    with pytest.raises(ValueError, match="not a page of the pool"):
        DecodeGraphs(runner.model, 8, MAX_LEN, scratch_page=4, capture=False)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device (none visible to torch)")
def test_captured_graphs_equal_eager_on_cuda():
    runner = make("cuda", torch.bfloat16, num_layers=4, pages=16)
    graphs = DecodeGraphs(runner.model, 8, MAX_LEN, scratch_page=15)
    assert graphs.capture and graphs.capture_s > 0
    # bf16: a padded batch of 4 multiplies in another order than eager's 3 rows, and
    # FlashInfer's CUDA-graph plan may split the KV otherwise: rounding, not a wrong page or
    # position (those move logits by whole units).
    graph_vs_eager(runner, graphs, atol=0.3)


@dataclasses.dataclass
class _Seq:
    prompt_ids: list[int]
    output_ids: list[int]
    page_ids: list[int]
    params: GenerationOptions
    rules: None = None  # no allowed-token rules

    def token_slice(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]


@dataclasses.dataclass
class _Batch:
    seqs: list[_Seq]
    num_cached: list[int]
    num_new: list[int]
    sample: list[bool]
    riders: list = dataclasses.field(default_factory=list)  # no fork children


def decode_through_execute(runner: ModelRunner) -> list[list[tuple[int, float]]]:
    """Five sequences decode greedily through `execute`: 8 steps of all 5, then 16 of the
    first 3; per sequence, each step's (token, gap between the two best logprobs)."""
    greedy = GenerationOptions(temperature=0.0, logprobs=True, top_logprobs=2)
    prompts = [list(range(1 + s, 12 + 3 * s)) for s in range(5)]
    seqs = [_Seq(p, [], list(range(3 * s, 3 * s + 3)), greedy) for s, p in enumerate(prompts)]
    steps: list[list[tuple[int, float]]] = [[] for _ in seqs]

    def record(live: list[_Seq], out) -> None:
        for s, t, top in zip(live, out.token_ids, out.top_logprobs):
            s.output_ids.append(int(t))
            steps[seqs.index(s)].append((int(t), top[0][1] - top[1][1]))

    record(seqs, runner.execute(_Batch(seqs, [0] * 5, [len(p) for p in prompts], [True] * 5)))
    for step in range(24):
        live = seqs if step < 8 else seqs[:3]
        cached = [len(s.prompt_ids) + len(s.output_ids) - 1 for s in live]
        record(live, runner.execute(_Batch(live, cached, [1] * len(live), [True] * len(live))))
    return steps


def test_runner_steps_through_graphs_as_eager():
    """`execute` with graphs of up to 4 (no capture): a batch of 5 runs eager, one of 3 the
    graph of 4 with a padded row; the same tokens as a runner without graphs (fp32)."""
    eager = decode_through_execute(make("cpu", torch.float32, num_layers=3, pages=17))
    runner = make("cpu", torch.float32, num_layers=3, pages=17)
    graphs = DecodeGraphs(runner.model, 4, MAX_LEN, scratch_page=16, capture=False)
    runner.accelerated = graphs  # the runner's one accelerator slot
    runs: list[int] = []
    graph_run = graphs.run

    def counting(input_ids: torch.Tensor, meta) -> torch.Tensor:
        runs.append(meta.batch_size)
        return graph_run(input_ids, meta)

    graphs.run = counting  # type: ignore[method-assign]

    def tokens(steps: list[list[tuple[int, float]]]) -> list[list[int]]:
        return [[t for t, _ in seq] for seq in steps]

    assert tokens(decode_through_execute(runner)) == tokens(eager)
    assert runs == [4] * 16  # the 16 steps of 3 sequences, and only those


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device (none visible to torch)")
def test_runner_with_graphs_decodes_as_eager_on_cuda():
    """`--cuda-graph-max-batch 4` on CUDA, bf16: the tokens of a runner without graphs. Two
    exact computations can still part at a near-tie in bf16 (FlashInfer's graph plan always
    splits the KV, eager's not for short contexts): a sequence may differ from the first
    position where eager's two best tokens are within 0.5 nats."""
    eager = decode_through_execute(make("cuda", torch.bfloat16, num_layers=None, pages=16))
    graphed = decode_through_execute(
        make("cuda", torch.bfloat16, num_layers=None, pages=16, cuda_graph_max_batch=4)
    )
    for e, g in zip(eager, graphed):
        for (te, gap), (tg, _) in zip(e, g):
            if te != tg:
                assert gap < 0.5, f"graph and eager part at a clear choice: {e} vs {g}"
                break


class _StandInDecodeWrapper:
    """Records what `FlashInferAttentionBackend` gives FlashInfer's decode wrapper."""

    def __init__(self, workspace, kv_layout, **kw):
        self.kw, self.plans = kw, []

    def plan(self, *args, **kw):
        self.plans.append((args, kw))


def test_flashinfer_graph_plan_plumbing(monkeypatch):
    """Without CUDA or FlashInfer: the backend's `plan_graph` makes one CUDA-graph wrapper per
    batch size, with fixed int32 buffers of the sizes FlashInfer checks (indptr b + 1, indices
    b * max_pages, last-page lengths b), reuses it for the next step of that size, and plans
    it with the step's host indptrs and device page ids."""
    import types

    from pd.worker.model.attention import flashinfer_backend as fb

    fake = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=lambda *a, **k: None,
        BatchDecodeWithPagedKVCacheWrapper=_StandInDecodeWrapper,
    )
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", fake)
    monkeypatch.setattr(fb, "_normalize_cuda", torch.device)
    monkeypatch.setattr(fb, "_workspace", lambda device: torch.zeros(8, dtype=torch.uint8))
    backend = fb.FlashInferAttentionBackend("cpu")
    wrappers = []
    for step in range(2):
        meta = build_paged_metadata([([3, 4], 20 + step, 1), ([7], 2, 1), ([9], 0, 1)], PAGE)
        backend.plan(meta, 9, 3, 64, PAGE, torch.bfloat16)
        assert backend.plan_graph(16, 0.125) is None
        wrappers.append(backend._wrapper)
    w = wrappers[0]
    assert wrappers[1] is w and len(w.plans) == 2
    assert w.kw["use_cuda_graph"] is True and w.kw["use_tensor_cores"] is False  # GQA group 3
    sizes = [w.kw[k].numel() for k in ("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                                       "paged_kv_last_page_len_buffer")]  # fmt: skip
    assert sizes == [4, 3 * 16, 3]
    assert all(w.kw[k].dtype == torch.int32 for k in w.kw if k.endswith("_buffer"))
    args, kw = w.plans[1]
    assert args[0].tolist() == [0, 2, 3, 4] and args[1].tolist() == [3, 4, 7, 9]
    assert args[2].tolist() == [6, 3, 1] and kw["sm_scale"] == 0.125  # 22, 3 and 1 tokens
    backend.plan(build_paged_metadata([([1], 0, 1)], PAGE), 9, 3, 64, PAGE, torch.bfloat16)
    backend.plan_graph(16, 0.125)
    assert backend._wrapper is not w  # another batch size, another wrapper
