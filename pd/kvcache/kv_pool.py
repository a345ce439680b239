"""The paged KV buffer of one TP rank, page-major, in FlashInfer's HND page layout.

One tensor per rank: `[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]`.
A page of every layer is one contiguous region (`page_bytes`), so a same-TP transfer moves one
region per page; within a page, the head slice of one (layer, K/V) is contiguous too, which is
what a heterogeneous-TP transfer reads. `layer_cache(layer)` is the strided per-layer view
`[num_pages, 2, num_kv_heads, page_size, head_dim]` that FlashInfer takes with kv_layout="HND"
(its page stride spans all layers).
"""

from __future__ import annotations

import torch

from pd.kvcache.huge_pages import cpu_pool


def bytes_per_page(
    num_layers: int, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one page across all layers, K and V, of one rank."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * num_kv_heads * page_size * head_dim * itemsize


def pages_for_budget(
    bytes_budget: int,
    num_layers: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """How many whole pages fit in `bytes_budget` bytes (per rank)."""
    if bytes_budget < 0:
        raise ValueError(f"bytes_budget must be >= 0, got {bytes_budget}")
    return bytes_budget // bytes_per_page(num_layers, num_kv_heads, page_size, head_dim, dtype)


class KVPool:
    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("page_size", page_size),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads  # of this rank
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # NOTE: zeroed, not left empty: a page read before it is written (a bug elsewhere) then
        # gives finite numbers, and a transferred page never carries another process's stale
        # bytes. On a CPU, its own mapping on huge pages (huge_pages.py).
        # [N, L, 2, Hkv, P, D]
        shape = (num_pages, num_layers, 2, num_kv_heads, page_size, head_dim)
        if self.device.type == "cpu":
            self.buffer, self.huge_page_bytes = cpu_pool(shape, dtype)
        else:
            self.buffer = torch.zeros(shape, dtype=dtype, device=self.device)
            self.huge_page_bytes = 0
        # For `rows_of`: the buffer as rows of head_dim items, a page spans `_page_rows` rows;
        # within a page, the row of slot 0 of each (layer, K/V, head).
        rows = [s // head_dim for s in self.buffer.stride()[:4]]
        self._page_rows = rows[0]
        self._within_page = (
            torch.arange(num_layers, device=self.device)[:, None, None] * rows[1]
            + torch.arange(2, device=self.device)[None, :, None] * rows[2]
            + torch.arange(num_kv_heads, device=self.device)[None, None, :] * rows[3]
        )  # [L, 2, Hkv]
        # The buffer as rows of head_dim items: the one tensor steps write and read K/V
        # through. A compiled step then mutates a graph input in place (inductor stores the new
        # rows and nothing else); a view taken inside the graph (`buffer.view(-1, D)
        # .index_put_`) was functionalized instead, the whole pool copied back every step
        # (docs/BENCHMARKS.md, "The compiled step in the worker").
        self._rows = self.buffer.view(-1, head_dim)
        self._page_shape = (num_layers, 2, num_kv_heads, page_size, head_dim)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.buffer.shape)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (all layers, K and V); pages are this far apart in memory."""
        return self.buffer.stride(0) * self.buffer.element_size()

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K and V within a page."""
        return self.buffer.stride(1) * self.buffer.element_size()

    @property
    def head_bytes(self) -> int:
        """Bytes of one (layer, K/V, head) slice within a page: page_size * head_dim items."""
        return self.buffer.stride(3) * self.buffer.element_size()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def data_ptr(self) -> int:
        """Base address of the buffer (for registering the pool with a transfer backend)."""
        return self.buffer.data_ptr()

    def page_addr(self, page_id: int) -> int:
        """Address of the first byte of `page_id`."""
        return self.data_ptr() + page_id * self.page_bytes

    def layer_cache(self, layer: int) -> torch.Tensor:
        """The strided view [num_pages, 2, Hkv, page_size, head_dim] of one layer."""
        # From `_rows` alone (a compiled step then takes no second, aliasing view of the pool)
        return self._rows.view(-1, *self._page_shape)[:, layer]  # [N, 2, Hkv, P, D]

    def rows_of(self, page_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Where a step's new tokens go, computed once per step: [L, T, 2, Hkv] indices into
        the buffer seen as rows of head_dim items (layer l, token t, K/V, head), for `write`.

        page_ids, offsets: [T] long (each token's page and slot), on the pool's device.
        """
        token = page_ids * self._page_rows + offsets  # [T]: row of (layer 0, K, head 0)
        return token[None, :, None, None] + self._within_page[:, None]  # [L, T, 2, Hkv]

    def write(self, layer: int, kv: torch.Tensor, rows: torch.Tensor) -> None:
        """Scatter new tokens' K/V [T, 2, Hkv, D] (K then V) into their slots, in one op;
        `rows` is `rows_of(...)` of the step (slots are distinct by construction)."""
        kv = kv if kv.dtype == self.dtype else kv.to(self.dtype)
        self._rows.index_put_((rows[layer],), kv)

    def __repr__(self) -> str:
        return (
            f"KVPool(pages={self.num_pages}, layers={self.num_layers}, "
            f"kv_heads={self.num_kv_heads}, page_size={self.page_size}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})"
        )
