"""Paged attention with FlashInfer's batch wrappers (CUDA, bf16/fp16 only).

Decode-only batches use BatchDecodeWithPagedKVCacheWrapper; any batch with a chunk uses
BatchPrefillWithPagedKVCacheWrapper with causal=True (bottom-right aligned, as the torch backend).
Both take the cache as one 5-D HND tensor [num_pages, 2, Hkv, page_size, D].

The per-layer view KVPool.layer_cache(layer) is not contiguous (its page stride spans all
layers). That is fine for FlashInfer 0.5-0.7: the FA2 kernels build `paged_kv_t` from the
tensor's own strides (stride_page = stride(0), stride_h = stride(1), stride_n = stride(2) of the
K and V halves, which are equal here) and the SM90 (FA3) path reads k_page_stride from
stride(0) likewise; nothing calls .contiguous() on the cache. Two limits follow from the
kernels: the last dim must be dense (stride 1), and `paged_kv_t.stride_page` is a uint32, so
one page of all layers must stay under 2**32 elements; forward() checks both. Were a kernel
ever to need a dense per-layer cache, the fix is a layer-major pool ([L, N, 2, H, P, D]), at
the price of one transfer descriptor per (page, layer) instead of one per page.

FlashInfer fixes sm_scale at plan time, while the interface passes it to forward(); the wrappers
are therefore planned lazily by the first forward() of a batch and replanned only if a later
layer passes a different scale.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pd.kvcache.paged_metadata import PagedMetadata
from pd.worker.model.attention.base import AttentionBackend, check_plan_args
from pd.worker.model.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace size
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)
# Process-wide: one float workspace per device, shared by every wrapper on it (the wrappers run
# one after another on the device's stream; their own int workspaces hold the plans).
_workspaces: dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        # Zeroed: the decode wrapper asks for a zero-initialized buffer on first use.
        _workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


def _normalize_cuda(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"FlashInfer needs a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class _PlanArgs:
    meta: PagedMetadata
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device | str) -> None:
        import flashinfer  # lazy: importable on CPU, but kernels need CUDA

        self._flashinfer = flashinfer
        self.device = _normalize_cuda(device)
        self._workspace = _workspace(self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout="HND"
        )
        self._decode: dict[bool, Any] = {}  # by use_tensor_cores
        self._graph_decode: dict[int, Any] = {}  # by batch size: CUDA-graph decode wrappers
        self._args: _PlanArgs | None = None
        self._wrapper: Any = None  # the wrapper planned for the current batch
        self._planned_scale: float | None = None

    def plan(
        self,
        meta: PagedMetadata,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
    ) -> None:
        check_plan_args(num_qo_heads, num_kv_heads, head_dim, page_size)
        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"FlashInfer has no {dtype} kernels; use the torch backend")
        if meta.page_size != page_size:
            raise ValueError(f"metadata page_size {meta.page_size} != plan page_size {page_size}")
        if meta.kv_indices.device != self.device:
            raise ValueError(f"metadata on {meta.kv_indices.device}, backend on {self.device}")
        self._args = _PlanArgs(meta, num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
        self._wrapper = None
        self._planned_scale = None

    def _decode_wrapper(self, use_tensor_cores: bool) -> Any:
        if use_tensor_cores not in self._decode:
            self._decode[use_tensor_cores] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, kv_layout="HND", use_tensor_cores=use_tensor_cores
            )
        return self._decode[use_tensor_cores]

    def _plan_decode(self, wrapper: Any, sm_scale: float) -> None:
        """Plan a decode wrapper for the step `plan` was given."""
        a = self._args
        assert a is not None, "plan() must run before forward()"
        m = a.meta
        wrapper.plan(
            m.kv_indptr_host,
            m.kv_indices,
            m.kv_last_page_len_host,
            a.num_qo_heads,
            a.num_kv_heads,
            a.head_dim,
            a.page_size,
            pos_encoding_mode="NONE",
            q_data_type=a.dtype,
            kv_data_type=a.dtype,
            sm_scale=sm_scale,
        )

    def _plan_wrapper(self, sm_scale: float) -> None:
        a = self._args
        assert a is not None, "plan() must run before forward()"
        m = a.meta
        # Host indptrs (FlashInfer reads them on the CPU while planning), device page ids.
        if m.is_decode_only:
            # FlashInfer recommends tensor cores for decode from a GQA group of 4 up.
            wrapper = self._decode_wrapper(a.num_qo_heads // a.num_kv_heads >= 4)
            self._plan_decode(wrapper, sm_scale)
        else:
            wrapper = self._prefill
            wrapper.plan(
                m.qo_indptr_host,
                m.kv_indptr_host,
                m.kv_indices,
                m.kv_last_page_len_host,
                a.num_qo_heads,
                a.num_kv_heads,
                a.head_dim,
                a.page_size,
                causal=True,
                sm_scale=sm_scale,
                q_data_type=a.dtype,
                kv_data_type=a.dtype,
            )
        self._wrapper = wrapper
        self._planned_scale = sm_scale

    def plan_graph(self, max_pages: int, sm_scale: float) -> None:
        """Plan this batch size's CUDA-graph decode wrapper (`use_cuda_graph=True`: its indptr,
        indices and last-page-length buffers are ours, fixed in size, and `plan` copies into
        them) for the step `plan` was given; the next `forward` runs it, inside the graph's
        capture or replay."""
        a = self._args
        assert a is not None, "plan() must run before plan_graph()"
        batch = a.meta.batch_size
        wrapper = self._graph_decode.get(batch)
        if wrapper is None:

            def ints(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=self.device)

            wrapper = self._graph_decode[batch] = (
                self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace,
                    kv_layout="HND",
                    use_cuda_graph=True,
                    use_tensor_cores=a.num_qo_heads // a.num_kv_heads >= 4,
                    paged_kv_indptr_buffer=ints(batch + 1),
                    paged_kv_indices_buffer=ints(batch * max_pages),
                    paged_kv_last_page_len_buffer=ints(batch),
                )
            )
        # NOTE: plan writes the wrapper's pinned host workspace and copies it to the device
        # asynchronously; the next plan of this bucket overwrites it. Safe because a step ends
        # in a sync (the sampler's .tolist(), or the runner's synchronize when nothing samples).
        self._plan_decode(wrapper, sm_scale)
        self._wrapper = wrapper
        self._planned_scale = sm_scale

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, sm_scale: float) -> torch.Tensor:
        assert kv_cache.stride(-1) == 1, "FlashInfer needs a dense head_dim"
        assert kv_cache.stride(0) < 2**32, (
            f"page stride {kv_cache.stride(0)} elements overflows FlashInfer's uint32 stride_page"
        )
        if self._wrapper is None or self._planned_scale != sm_scale:
            self._plan_wrapper(sm_scale)
        return self._wrapper.run(q, kv_cache)  # [T, Hq, D]


ATTENTION_BACKENDS = ("auto", "flashinfer", "torch")


def select_attention_backend(
    device: torch.device | str, dtype: torch.dtype, want: str = "auto", uniform: bool = False
) -> AttentionBackend:
    """`auto`: FlashInfer on CUDA for bf16/fp16, the torch backend otherwise (CPU, or fp32
    anywhere, or FlashInfer not installed, with a warning). `flashinfer` refuses to fall back:
    a clear error instead. `torch`: the torch backend. `uniform` (--deterministic): the torch
    backend with every row computed as a decode row (`TorchAttentionBackend`)."""
    device = torch.device(device)
    if uniform:
        if want == "flashinfer":
            raise ValueError("--deterministic runs the torch attention backend, not flashinfer")
        return TorchAttentionBackend(uniform=True)
    if want == "torch":
        return TorchAttentionBackend()
    if want == "flashinfer":
        if device.type != "cuda" or dtype not in FLASHINFER_DTYPES:
            raise ValueError(
                f"--attention-backend flashinfer needs --device cuda and a bf16/fp16 --dtype "
                f"(got {device.type}, {str(dtype).removeprefix('torch.')})"
            )
        try:
            return FlashInferAttentionBackend(device)
        except ImportError as e:
            raise ValueError(f"--attention-backend flashinfer: flashinfer is unusable: {e}") from e
    if want != "auto":
        raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}")
    if device.type == "cuda" and dtype in FLASHINFER_DTYPES:
        try:
            return FlashInferAttentionBackend(device)
        except ImportError:
            logger.warning(
                "flashinfer is not installed: using the (slow) torch attention on %s", device
            )
    return TorchAttentionBackend()
