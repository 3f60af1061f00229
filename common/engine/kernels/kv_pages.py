"""Gather and scatter whole KV pages of many layer buffers through one staging tensor (the transfer layer's copy).

Every buffer is ``[num_slots, *slot_shape]`` with ``num_slots % page_size == 0``; page ``p`` is slots
``[p * page_size, (p + 1) * page_size)``. The staging tensor is ``[len(buffers), len(page_ids), page_size,
*slot_shape]``, buffers in the caller's order (the transfer layer uses K0, V0, K1, V1, ...)::

    staging[b, i] == buffers[b][page_ids[i] * page_size : (page_ids[i] + 1) * page_size]

On CPU these are the torch reference below; on CUDA one Triton launch copies every buffer
(``common.engine.kernels.kv_pages_triton``, imported on first CUDA use so a CPU process never loads Triton).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def gather_pages_ref(buffers: Sequence[torch.Tensor], page_ids: torch.Tensor, page_size: int,
                     out: torch.Tensor) -> None:
    for b, buf in enumerate(buffers):
        torch.index_select(buf.view(-1, page_size, *buf.shape[1:]), 0, page_ids, out=out[b])


def scatter_pages_ref(buffers: Sequence[torch.Tensor], page_ids: torch.Tensor, page_size: int,
                      src: torch.Tensor) -> None:
    for b, buf in enumerate(buffers):
        buf.view(-1, page_size, *buf.shape[1:]).index_copy_(0, page_ids, src[b])


def gather_pages(buffers: Sequence[torch.Tensor], page_ids: torch.Tensor, page_size: int, out: torch.Tensor) -> None:
    """``out[b, i] = page page_ids[i] of buffers[b]``; ``page_ids`` int64 on the buffers' device."""
    if buffers and buffers[0].is_cuda:
        from common.engine.kernels.kv_pages_triton import gather_pages_triton

        gather_pages_triton(buffers, page_ids, page_size, out)
    else:
        gather_pages_ref(buffers, page_ids, page_size, out)


def scatter_pages(buffers: Sequence[torch.Tensor], page_ids: torch.Tensor, page_size: int, src: torch.Tensor) -> None:
    """``page page_ids[i] of buffers[b] = src[b, i]``; page ids must be distinct."""
    if buffers and buffers[0].is_cuda:
        from common.engine.kernels.kv_pages_triton import scatter_pages_triton

        scatter_pages_triton(buffers, page_ids, page_size, src)
    else:
        scatter_pages_ref(buffers, page_ids, page_size, src)


def copy_pages_ref(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], ids: torch.Tensor,
                   page_size: int) -> None:
    for s_buf, d_buf in zip(src, dst, strict=True):
        pages = s_buf.view(-1, page_size, *s_buf.shape[1:])
        d_buf.view(-1, page_size, *d_buf.shape[1:]).index_copy_(0, ids[1], pages.index_select(0, ids[0]))


def page_copier(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], page_size: int) -> Callable[[torch.Tensor], None]:
    """A copy between these two lists of buffers, its checks and address tables done once: the returned callable
    takes ``ids`` (int64 [2, n] on the buffers' device) and makes page ``ids[1, i]`` of every ``dst[b]`` page
    ``ids[0, i]`` of ``src[b]`` (on CUDA a ``kv_pages_triton.PageCopier``: one launch per call; else the reference)."""
    if src and src[0].is_cuda:
        from common.engine.kernels.kv_pages_triton import PageCopier

        return PageCopier(src, dst, page_size)
    if len(src) != len(dst) or not src:
        raise ValueError(f"copy_pages: {len(src)} source and {len(dst)} destination buffers")
    src, dst = list(src), list(dst)
    return lambda ids: copy_pages_ref(src, dst, ids, page_size)


def buffer_table(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """The device table of the buffers' base addresses the CUDA kernels take (build it once per pool)."""
    first = buffers[0]
    for buf in buffers:
        if buf.dtype != first.dtype or buf.device != first.device or not buf.is_contiguous():
            raise ValueError("copy_pages: buffers must be contiguous, of one dtype and one device")
    return torch.tensor([buf.data_ptr() for buf in buffers], dtype=torch.int64).to(first.device)
