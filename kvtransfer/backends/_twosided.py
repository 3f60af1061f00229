"""The two-sided message plan of a job (``nccl``; ``ucx`` writes one-sided): its payload messages (the messages
themselves are in ``wire``).

A two-sided transport needs the receiver to post one receive per message, so every job is announced first::

    prefill -> decode   ChunkHeader(room, chunk_id, dst_runs, heads, nbytes, pack_bytes)
    prefill -> decode   payload messages (below)
    decode -> prefill   ChunkAck(room, chunk_id, error)     after every payload message landed (and was scattered)

Payload: the slices ``for layer: for K, V: for run`` (whole pages, or the head slice of each slot), in that order.
A slice of at least ``pack_bytes // 4`` whole pages is one message, straight from the source pool into the
destination pool (zero-copy). Smaller slices (and every head slice: it is strided) are packed in order into staging
messages of up to ``pack_bytes``; ``pack_bytes == 0`` sends every slice alone. Per-message cost dominates small
runs on every transport here, so packing 4 x 16-token pages (128 KiB) into 4 MiB messages pays for its two copies.
Both sides derive the message list from the header with ``plan_messages``, so sizes are known before data arrives::

    slices:    K0:r0 (2 MiB) | K0:r1 | K0:r2 | V0:r0 (2 MiB) | V0:r1 | V0:r2 | K1:r0 ...     (pack_bytes = 4 MiB)
    messages:  [K0:r0]         [K0:r1 K0:r2 V0:r1 V0:r2 K1:r1 ...]   [V0:r0]   ...
               direct          staged (flushed when the next slice would overflow it)
The decode side checks every destination run against its own pool ([1, num_pages) and heads in [0, kv_heads))
before it posts a receive; a header that does not fit is refused and the connection is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.args import KVArgs
from kvtransfer.backends.base import TransferJob
from kvtransfer.backends.wire import ChunkHeader, layer_buffers


@dataclass
class Message:
    """One payload message: one contiguous pool slice (``direct``) or several slices packed in order."""

    slices: list[torch.Tensor]
    direct: bool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.slices) * self.slices[0].element_size()

    def gather(self) -> torch.Tensor:
        """Source side: the tensor to send (the pool slice itself, or a fresh staging copy of the slices)."""
        if self.direct:
            return self.slices[0]
        staging = torch.empty(sum(t.numel() for t in self.slices), dtype=self.slices[0].dtype,
                              device=self.slices[0].device)
        off = 0
        for t in self.slices:
            _copy(staging[off:off + t.numel()].view(t.shape), t)
            off += t.numel()
        return staging

    def landing(self) -> torch.Tensor:
        """Destination side: where to receive (the pool slice itself, or an empty staging tensor)."""
        if self.direct:
            return self.slices[0]
        return torch.empty(sum(t.numel() for t in self.slices), dtype=self.slices[0].dtype,
                           device=self.slices[0].device)

    def scatter(self, landed: torch.Tensor) -> None:
        """Destination side: copy a received staging tensor into the pool slices (no-op when direct)."""
        if self.direct:
            return
        off = 0
        for t in self.slices:
            _copy(t, landed[off:off + t.numel()].view(t.shape))
            off += t.numel()


def plan_messages(args: KVArgs, runs: list[tuple[int, int]], heads: tuple[int, int] | None,
                  pack_bytes: int) -> list[Message]:
    """The payload messages over ``runs`` ((first page, pages) on this side) and ``heads`` ((first head, heads) on
    this side, None = whole pages); both sides call it with their own pages and get the same sizes and order."""
    ps, msgs, pack, packed = args.page_size, [], [], 0
    for buf in layer_buffers(args):
        for p, n in runs:
            view = buf[p * ps:(p + n) * ps]
            if heads is not None:
                view = view[:, heads[0]:heads[0] + heads[1]]
            nbytes = view.numel() * view.element_size()
            if heads is None and (pack_bytes == 0 or nbytes >= pack_bytes // 4):
                msgs.append(Message([view], direct=True))
                continue
            if pack and packed + nbytes > pack_bytes:
                msgs.append(Message(pack, direct=False))
                pack, packed = [], 0
            pack.append(view)
            packed += nbytes
    if pack:
        msgs.append(Message(pack, direct=False))
    return msgs


def source_messages(args: KVArgs, job: TransferJob, pack_bytes: int) -> tuple[ChunkHeader, list[Message]]:
    """Prefill: the header announcing ``job`` and its payload messages."""
    heads = None if job.heads is None else (job.heads.src_head, job.heads.num_heads)
    msgs = plan_messages(args, [(r.src_page, r.num_pages) for r in job.runs], heads, pack_bytes)
    header = ChunkHeader(job.room, job.chunk_id, [(r.dst_page, r.num_pages) for r in job.runs],
                         None if job.heads is None else (job.heads.src_head, job.heads.dst_head, job.heads.num_heads),
                         sum(m.nbytes for m in msgs), pack_bytes=pack_bytes)
    return header, msgs


class RefusedHeader(ValueError):
    """A header whose runs or heads do not fit this rank's pool (nothing of it may be written)."""


def destination_messages(args: KVArgs, header: ChunkHeader) -> list[Message]:
    """Decode: the payload messages of ``header`` in this rank's pool; raises RefusedHeader unless every run and
    head fits the pool and the sizes agree with the sender's."""
    bad = [(p, n) for p, n in header.dst_runs if p < 1 or n < 1 or p + n > args.num_pages]
    if bad:
        raise RefusedHeader(f"destination runs {bad[:3]} outside pages [1, {args.num_pages})")
    heads = None
    if header.heads is not None:
        _, h0, nh = header.heads
        if h0 < 0 or nh < 1 or h0 + nh > args.kv_heads:
            raise RefusedHeader(f"destination heads [{h0}, {h0 + nh}) outside [0, {args.kv_heads})")
        heads = (h0, nh)
    if header.pack_bytes < 0:
        raise RefusedHeader(f"pack_bytes {header.pack_bytes} < 0")
    msgs = plan_messages(args, header.dst_runs, heads, header.pack_bytes)
    nbytes = sum(m.nbytes for m in msgs)
    if nbytes != header.nbytes:
        raise RefusedHeader(f"payload of {header.nbytes} bytes does not match the {nbytes} bytes its runs cover")
    return msgs


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; on CPU through numpy (single-threaded): torch's copy of small bf16 slices is far slower
    (benchmarks/pages/kv_transfer.md). Both are views whose last dimension is contiguous."""
    if dst.device.type == "cpu":
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        dst.copy_(src)

