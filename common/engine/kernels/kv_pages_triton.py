"""Triton page gather/scatter over many layer buffers in one launch (the CUDA path of ``common.engine.kernels.kv_pages``).

The buffers are passed as a device table of their base addresses (int64 ``data_ptr``s, all of one dtype); each
program copies one BLOCK-element piece of one page of one buffer (grid: pages x buffers x pieces). ``row`` = elements of one page
(``page_size * prod(slot_shape)``)::

    gather:  staging[b, i, :] = buffer_b[page_ids[i] * row : (page_ids[i] + 1) * row]
    scatter: the reverse.
    copy:    page dst_ids[i] of dst_b = page src_ids[i] of src_b  (no staging: half the memory traffic)

A base address loaded from the table has no alignment Triton can see, so without a hint every element moves as its
own 2-byte load and store (half the device-copy speed on an H200). ``ALIGNED`` (every base address and page 16-byte
aligned, checked on the host by ``_aligned``) marks the page's pointers as 16-byte multiples: 16-byte vector loads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from common.engine.kernels.kv_pages import buffer_table


@triton.jit
def _copy_pages(
    BufPtrs, PageIds, Staging, Like, num_pages, row, GATHER: tl.constexpr, BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    i = tl.program_id(0)  # pages on axis 0: the only grid axis not capped at 65535
    b = tl.program_id(1).to(tl.int64)  # staging offsets overflow int32 at real sizes
    chunk = tl.program_id(2)
    page = tl.load(PageIds + i)
    base = tl.load(BufPtrs + b).to(tl.pointer_type(Like.dtype.element_ty))
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row
    buf = base + page * row + offs
    stage = Staging + (b * num_pages + i) * row + offs
    if ALIGNED:
        buf = tl.multiple_of(buf, 16)
        stage = tl.multiple_of(stage, 16)
    if GATHER:
        tl.store(stage, tl.load(buf, mask=mask), mask=mask)
    else:
        tl.store(buf, tl.load(stage, mask=mask), mask=mask)


def _launch(buffers: Sequence[torch.Tensor], page_ids: torch.Tensor, page_size: int, staging: torch.Tensor,
            gather: bool) -> None:
    first = buffers[0]
    for buf in buffers:
        if buf.dtype != first.dtype or buf.device != first.device or not buf.is_contiguous():
            raise ValueError("gather/scatter_pages: buffers must be contiguous, of one dtype and one device")
    if page_ids.device != first.device or staging.device != first.device or page_ids.dtype != torch.int64:
        raise ValueError(
            f"gather/scatter_pages: page_ids (int64) and staging must be on the buffers' device {first.device}, got "
            f"page_ids {page_ids.dtype} on {page_ids.device}, staging on {staging.device}"
        )
    if not staging.is_contiguous() or staging.dtype != first.dtype:
        raise ValueError("gather/scatter_pages: the staging tensor must be contiguous and of the buffers' dtype")
    n = page_ids.shape[0]
    expect = (len(buffers), n, page_size, *first.shape[1:])
    if tuple(staging.shape) != expect:
        raise ValueError(f"gather/scatter_pages: staging is {tuple(staging.shape)}, expected {expect}")
    if n == 0:
        return
    row = page_size * first[0].numel()
    ptrs = torch.tensor([buf.data_ptr() for buf in buffers], dtype=torch.int64).to(first.device, non_blocking=True)
    block = min(4096, triton.next_power_of_2(row))
    _copy_pages[(n, len(buffers), triton.cdiv(row, block))](
        ptrs, page_ids, staging, first, n, row, GATHER=gather, BLOCK=block,
        ALIGNED=_aligned([*buffers, staging], row),
    )


def gather_pages_triton(buffers: Sequence[torch.Tensor], page_ids: torch.Tensor, page_size: int,
                        out: torch.Tensor) -> None:
    _launch(buffers, page_ids, page_size, out, gather=True)


def scatter_pages_triton(buffers: Sequence[torch.Tensor], page_ids: torch.Tensor, page_size: int,
                         src: torch.Tensor) -> None:
    _launch(buffers, page_ids, page_size, src, gather=False)


@triton.jit
def _copy_pages_direct(SrcPtrs, DstPtrs, Ids, Like, num_pages, row, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    i = tl.program_id(0)
    b = tl.program_id(1)
    chunk = tl.program_id(2)
    src_page = tl.load(Ids + i)
    dst_page = tl.load(Ids + num_pages + i)
    src = tl.load(SrcPtrs + b).to(tl.pointer_type(Like.dtype.element_ty))
    dst = tl.load(DstPtrs + b).to(tl.pointer_type(Like.dtype.element_ty))
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row
    src = src + src_page * row + offs
    dst = dst + dst_page * row + offs
    if ALIGNED:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


class PageCopier:
    """``copy_pages`` between two fixed lists of buffers, checked once: each call only launches (a KV transfer copies
    every job between the same two pools, and checking 2 x 64 buffers per call cost more host time than the launch).

    ``dst`` may be another process's memory mapped here. Invariant: the buffers stay allocated while the copier lives.
    """

    def __init__(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], page_size: int) -> None:
        if len(src) != len(dst) or not src:
            raise ValueError(f"copy_pages: {len(src)} source and {len(dst)} destination buffers")
        first = src[0]
        if any(d.shape[1:] != first.shape[1:] or d.dtype != first.dtype or d.device != first.device for d in dst):
            raise ValueError("copy_pages: source and destination buffers differ in slot shape, dtype or device")
        self.like = first
        self.device = first.device
        self.num_buffers = len(src)
        self.row = page_size * first[0].numel()
        self.block = min(4096, triton.next_power_of_2(self.row))
        self.src_table = buffer_table(src)
        self.dst_table = buffer_table(dst)
        self.aligned = _aligned([*src, *dst], self.row)

    def __call__(self, ids: torch.Tensor) -> None:
        """Page ``ids[1, i]`` of every destination buffer = page ``ids[0, i]`` of its source buffer; ``ids``: int64
        [2, n] on the buffers' device, destination pages distinct. Enqueued on the current stream."""
        if ids.dtype != torch.int64 or ids.device != self.device or ids.dim() != 2 or ids.shape[0] != 2:
            raise ValueError(f"copy_pages: ids must be int64 [2, n] on {self.device}, got {ids.dtype} "
                             f"{tuple(ids.shape)} on {ids.device}")
        n = ids.shape[1]
        if n == 0:
            return
        _copy_pages_direct[(n, self.num_buffers, triton.cdiv(self.row, self.block))](
            self.src_table, self.dst_table, ids.contiguous(), self.like, n, self.row, BLOCK=self.block,
            ALIGNED=self.aligned,
        )


def copy_pages_triton(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], ids: torch.Tensor,
                      page_size: int) -> None:
    """Page ``ids[1, i]`` of every ``dst[b]`` = page ``ids[0, i]`` of ``src[b]``, one launch for all buffers, once
    (copying between the same buffers again and again: build a ``PageCopier``)."""
    PageCopier(src, dst, page_size)(ids)


def _aligned(tensors: Sequence[torch.Tensor], row: int) -> bool:
    """Every tensor's base and every page (``row`` elements) starts on a 16-byte boundary (the kernels' hint)."""
    return (row * tensors[0].element_size()) % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)
