"""Gather and scatter whole KV pages of many layer buffers through one staging tensor (the transfer layer's copy).

Every buffer is ``[num_slots, *slot_shape]`` with ``num_slots % page_size == 0``; page ``p`` is slots
``[p * page_size, (p + 1) * page_size)``. The staging tensor is ``[len(buffers), len(page_ids), page_size,
*slot_shape]``, buffers in the caller's order (the transfer layer uses K0, V0, K1, V1, ...)::

    staging[b, i] == buffers[b][page_ids[i] * page_size : (page_ids[i] + 1) * page_size]

On CPU these are the torch reference below; on CUDA one Triton launch copies every buffer
(``common.engine.kernels.kv_pages_triton``, imported on first CUDA use so a CPU process never loads Triton).
"""

from __future__ import annotations

from collections.abc import Sequence

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
