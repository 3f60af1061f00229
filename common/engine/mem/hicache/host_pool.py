"""``HostKVPool``: host copies of KV pages, page-granular, bounded; pinned on CUDA (``--hicache-mem-layout``).

A host page holds one device page of every buffer of the device pool's slot space: the target's layers and the
layers a drafter keeps under the target's slot numbering (``DraftKV``: EAGLE's head, a P/D node's STANDALONE draft
model), in the order of ``common.engine.kernels.kv_pages`` and the KV transfer layer: K0, V0, K1, V1, ..., the extra
layers' after the target's (``slot_space_groups``). Consecutive buffers of one slot geometry (KV heads, head dim,
dtype) form a group; each group has a host buffer of its own, of ``num_buffers`` buffers each
``[page_size, heads, head_dim]``::

    layer_first  buffer[b, page]      one buffer's pages contiguous (the device pool's own layout)
    page_first   buffer[page, b]      one page's buffers contiguous (a storage record is one slice per group)

Copies move a batch of pages at once through a staging tensor per group ``[num_buffers, n, page_size, heads,
head_dim]`` (``Staging``; ``gather``/``scatter`` below: one index op per group for the whole batch, not one per
page). A page's storage record is its bytes of every group, in group order (``staged_page_bytes``/``set_page_bytes``).

Ownership: the scheduler thread allocates and frees (``alloc``/``free``); a page is read or written by a copy thread
only while a job owns it, and the cache keeps such pages away from ``free`` until the job is done (see
``hiradix_cache``). Page ids are ``0 .. num_pages - 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.engine.mem.kv_pool import MHATokenToKVPool

Staging = list[torch.Tensor]  # one tensor per group, [num_buffers, n, page_size, heads, head_dim]


def slot_space_groups(pool: MHATokenToKVPool, extra_layers: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
                      ) -> list[list[torch.Tensor]]:
    """Every device buffer under the pool's slot numbering (its layers, then ``extra_layers``: (K, V) of a drafter's
    layers), K and V alternating, grouped in maximal runs of one slot geometry and dtype."""
    slots = pool.k_buffer[0].shape[0]
    groups: list[list[torch.Tensor]] = []
    for layer in (*zip(pool.k_buffer, pool.v_buffer, strict=True), *extra_layers):
        for buf in layer:
            if buf.shape[0] != slots or buf.dim() != 3 or not buf.is_contiguous():
                raise ValueError(f"a KV buffer of the slot space is {tuple(buf.shape)}: it must be contiguous, "
                                 f"[{slots}, heads, head_dim]")
            if groups and (groups[-1][0].shape, groups[-1][0].dtype) == (buf.shape, buf.dtype):
                groups[-1].append(buf)
            else:
                groups.append([buf])
    return groups


def device_page_bytes(groups: Sequence[Sequence[torch.Tensor]], page_size: int) -> int:
    """Bytes of one page of every buffer of ``groups`` (one host page)."""
    return sum(len(g) * page_size * math.prod(g[0].shape[1:]) * g[0].element_size() for g in groups)


@dataclass(eq=False)
class HostGroup:
    num_buffers: int
    page_shape: tuple[int, int, int]  # (page_size, heads, head_dim)
    dtype: torch.dtype
    buffer: torch.Tensor  # [num_buffers, num_pages, *page_shape] or [num_pages, num_buffers, *page_shape]

    @property
    def page_bytes(self) -> int:
        return self.num_buffers * math.prod(self.page_shape) * self.buffer.element_size()


class HostKVPool:
    def __init__(self, device_groups: Sequence[Sequence[torch.Tensor]], page_size: int, num_pages: int, layout: str,
                 pin: bool) -> None:
        if num_pages <= 0:
            raise ValueError(f"the host KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.layout = layout
        self.groups: list[HostGroup] = []
        for bufs in device_groups:
            page_shape = (page_size, bufs[0].shape[1], bufs[0].shape[2])
            shape = (len(bufs), num_pages) if layout == "layer_first" else (num_pages, len(bufs))
            # empty, not zeros: a host page is read only after a write (or a storage read) filled it, and an unpinned
            # buffer commits its memory as it fills rather than at start-up
            buffer = torch.empty((*shape, *page_shape), dtype=bufs[0].dtype, pin_memory=pin)
            self.groups.append(HostGroup(len(bufs), page_shape, bufs[0].dtype, buffer))
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: lowest id handed out first
        self._is_free = [True] * num_pages

    # -- sizes -----------------------------------------------------------------------------------------------------
    @property
    def bytes_per_page(self) -> int:
        return sum(g.page_bytes for g in self.groups)

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
    def empty_staging(self, n: int, pin: bool = False) -> Staging:
        return [torch.empty((g.num_buffers, n, *g.page_shape), dtype=g.dtype, pin_memory=pin) for g in self.groups]

    def scatter(self, pages: torch.Tensor, staging: Staging) -> None:
        """``page pages[i] = staging[g][:, i]`` for every group g (one index op each)."""
        for g, src in zip(self.groups, staging, strict=True):
            if self.layout == "layer_first":
                g.buffer.index_copy_(1, pages, src)
            else:
                g.buffer.index_copy_(0, pages, src.transpose(0, 1))

    def gather(self, pages: torch.Tensor, out: Staging) -> None:
        """``out[g][:, i] = page pages[i]`` for every group g (one index op each)."""
        for g, dst in zip(self.groups, out, strict=True):
            if self.layout == "layer_first":
                torch.index_select(g.buffer, 1, pages, out=dst)
            else:
                dst.copy_(g.buffer.index_select(0, pages).transpose(0, 1))

    @staticmethod
    def staged_page_bytes(staging: Staging, i: int) -> bytes:
        """The storage payload of staged page ``i``: its bytes of every group, in group order."""
        return b"".join(s[:, i].contiguous().view(torch.uint8).numpy().tobytes() for s in staging)

    def set_page_bytes(self, page: int, payload: memoryview) -> None:
        """Fill ``page`` from a storage payload (``bytes_per_page`` bytes, ``staged_page_bytes``'s layout)."""
        offset = 0
        for g in self.groups:
            n = g.page_bytes
            data = torch.frombuffer(payload[offset: offset + n], dtype=torch.uint8).view(g.dtype).view(
                g.num_buffers, *g.page_shape)
            offset += n
            if self.layout == "layer_first":
                g.buffer[:, page].copy_(data)
            else:
                g.buffer[page].copy_(data)
