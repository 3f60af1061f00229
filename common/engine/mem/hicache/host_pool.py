"""``HostKVPool``: host copies of KV pages, page-granular, bounded; pinned on CUDA (``--hicache-mem-layout``).

A host page holds one device page of every layer: ``2 * num_layers`` buffers (K0, V0, K1, V1, ...: the order of
``common.engine.kernels.kv_pages`` and the KV transfer layer), each ``[page_size, num_kv_heads, head_dim]``::

    layer_first  buffer[b, page]      one buffer's pages contiguous (the device pool's own layout)
    page_first   buffer[page, b]      one page's buffers contiguous (a storage record is one slice)

Copies move a batch of pages at once through a staging tensor ``[2 * num_layers, n, page_size, heads, head_dim]``
(``gather``/``scatter`` below: one index op for the whole batch, not one per page).

Ownership: the scheduler thread allocates and frees (``alloc``/``free``); a page is read or written by a copy thread
only while a job owns it, and the cache keeps such pages away from ``free`` until the job is done (see
``hiradix_cache``). Page ids are ``0 .. num_pages - 1``.
"""

from __future__ import annotations

import torch

from common.engine.mem.kv_pool import MHATokenToKVPool


class HostKVPool:
    def __init__(self, device_pool: MHATokenToKVPool, num_pages: int, layout: str, pin: bool) -> None:
        if num_pages <= 0:
            raise ValueError(f"the host KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = device_pool.page_size
        self.layout = layout
        self.num_buffers = 2 * device_pool.num_layers
        self.page_shape = (device_pool.page_size, device_pool.num_kv_heads, device_pool.head_dim)
        self.dtype = device_pool.dtype
        shape = ((self.num_buffers, num_pages) if layout == "layer_first" else (num_pages, self.num_buffers))
        # empty, not zeros: a host page is read only after a write (or a storage read) filled it, and an unpinned
        # buffer commits its memory as it fills rather than at start-up
        self.buffer = torch.empty((*shape, *self.page_shape), dtype=self.dtype, pin_memory=pin)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: lowest id handed out first
        self._is_free = [True] * num_pages

    # -- sizes -----------------------------------------------------------------------------------------------------
    @property
    def bytes_per_page(self) -> int:
        return self.num_buffers * self.page_shape[0] * self.page_shape[1] * self.page_shape[2] * (
            self.buffer.element_size())

    @property
    def available_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    # -- allocation (scheduler thread) -----------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free page ids (int64), or None (nothing taken)."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        for p in taken:
            self._is_free[p] = False
        return torch.tensor(taken, dtype=torch.int64)

    def free(self, pages: torch.Tensor) -> None:
        """Give pages back; a page that is free already raises (a double free) and nothing is freed."""
        ids = pages.tolist()
        if len(set(ids)) != len(ids) or any(self._is_free[p] for p in ids):
            raise RuntimeError(f"HostKVPool.free: pages not allocated (double free?): {ids}")
        for p in ids:
            self._is_free[p] = True
        self._free.extend(ids)

    def clear(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._is_free = [True] * self.num_pages

    # -- data (copy and storage threads, on pages their job owns) --------------------------------------------------
    def empty_staging(self, n: int, pin: bool = False) -> torch.Tensor:
        return torch.empty((self.num_buffers, n, *self.page_shape), dtype=self.dtype, pin_memory=pin)

    def scatter(self, pages: torch.Tensor, staging: torch.Tensor) -> None:
        """``page pages[i] = staging[:, i]`` (one index op)."""
        if self.layout == "layer_first":
            self.buffer.index_copy_(1, pages, staging)
        else:
            self.buffer.index_copy_(0, pages, staging.transpose(0, 1))

    def gather(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        """``out[:, i] = page pages[i]`` (one index op)."""
        if self.layout == "layer_first":
            torch.index_select(self.buffer, 1, pages, out=out)
        else:
            out.copy_(self.buffer.index_select(0, pages).transpose(0, 1))

    def page(self, page: int) -> torch.Tensor:
        """One page, ``[num_buffers, page_size, heads, head_dim]`` (a view for page_first, a copy otherwise)."""
        return self.buffer[:, page].contiguous() if self.layout == "layer_first" else self.buffer[page]

    def set_page(self, page: int, data: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.buffer[:, page].copy_(data)
        else:
            self.buffer[page].copy_(data)
