"""What the two-sided message backends (``nccl``, ``ucx``) share: the per-job messages and the buffer views.

A two-sided transport needs the receiver to post one receive per message, so every job is announced first::

    prefill -> decode   ChunkHeader(room, chunk_id, dst_runs, heads, nbytes)
    prefill -> decode   payload: for layer: for K, V: for run: one message (whole pages or a staged head slice)
    decode -> prefill   ChunkAck(room, chunk_id, error)     after every payload message landed (and was scattered)

Both sides derive the message list from the job in the same order (``source_tensors`` / ``DestinationPlan``), so a
message's size is known before it arrives and whole-page runs move straight between the KV pools (no staging).
The decode side checks every destination run against its own pool ([1, num_pages) and heads in [0, kv_heads))
before it posts a receive; a header that does not fit is refused and the connection is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from kvtransfer.args import KVArgs
from kvtransfer.backends.base import TransferJob


class DataHello(msgspec.Struct, frozen=True, tag=True):
    """First message on a data connection: which prefill rank (start) is talking."""

    instance_id: str
    epoch: int


class ChunkHeader(msgspec.Struct, frozen=True, tag=True):
    room: int
    chunk_id: int
    dst_runs: list[tuple[int, int]]  # (first destination page, pages), in the job's run order
    heads: tuple[int, int, int] | None  # (src_head, dst_head, num_heads); None = whole pages
    nbytes: int  # payload bytes over all messages (a consistency check)


class ChunkAck(msgspec.Struct, frozen=True, tag=True):
    room: int
    chunk_id: int
    error: str = ""


AnyDataMessage = DataHello | ChunkHeader | ChunkAck
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyDataMessage)


def encode(msg: AnyDataMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> AnyDataMessage:
    """Raises msgspec.DecodeError/ValidationError on bytes that are not a data-plane message."""
    return _decoder.decode(data)


def layer_buffers(args: KVArgs) -> list[torch.Tensor]:
    """The pool's buffers in payload order: K0, V0, K1, V1, ..."""
    return [buf for pair in zip(args.k_buffers, args.v_buffers, strict=True) for buf in pair]


def source_tensors(args: KVArgs, job: TransferJob) -> list[torch.Tensor]:
    """Prefill: one contiguous tensor per payload message. Whole-page runs are views of the pool (no copy);
    head slices are gathered into fresh staging tensors (a strided slice cannot be one message)."""
    ps, h = args.page_size, job.heads
    out = []
    for buf in layer_buffers(args):
        for run in job.runs:
            pages = buf[run.src_page * ps:(run.src_page + run.num_pages) * ps]
            out.append(pages if h is None else pages[:, h.src_head:h.src_head + h.num_heads].contiguous())
    return out


def header_for(job: TransferJob, tensors: list[torch.Tensor]) -> ChunkHeader:
    heads = None if job.heads is None else (job.heads.src_head, job.heads.dst_head, job.heads.num_heads)
    return ChunkHeader(job.room, job.chunk_id, [(r.dst_page, r.num_pages) for r in job.runs], heads,
                       sum(t.numel() * t.element_size() for t in tensors))


@dataclass
class DestinationPlan:
    """Decode: where each payload message of one header lands, and the scatter of staged head slices."""

    tensors: list[torch.Tensor]  # one contiguous receive target per message, in payload order
    scatter: list[tuple[torch.Tensor, torch.Tensor]]  # (pool slice, staging) copied after the receives

    def finish(self) -> None:
        """Copy staged head slices into the pool (whole-page runs already landed in place)."""
        for dst, staged in self.scatter:
            dst.copy_(staged)


class RefusedHeader(ValueError):
    """A header whose runs or heads do not fit this rank's pool (nothing of it may be written)."""


def plan_destination(args: KVArgs, header: ChunkHeader) -> DestinationPlan:
    """Receive targets for ``header``; raises RefusedHeader unless every run and head fits this rank's pool."""
    bad = [(p, n) for p, n in header.dst_runs if p < 1 or n < 1 or p + n > args.num_pages]
    if bad:
        raise RefusedHeader(f"destination runs {bad[:3]} outside pages [1, {args.num_pages})")
    heads = header.heads
    if heads is not None:
        _, h0, nh = heads
        if h0 < 0 or nh < 1 or h0 + nh > args.kv_heads:
            raise RefusedHeader(f"destination heads [{h0}, {h0 + nh}) outside [0, {args.kv_heads})")
    ps, tensors, scatter = args.page_size, [], []
    for buf in layer_buffers(args):
        for p, n in header.dst_runs:
            pages = buf[p * ps:(p + n) * ps]
            if heads is None:
                tensors.append(pages)
            else:
                staged = torch.empty((n * ps, heads[2], args.head_dim), dtype=args.dtype, device=buf.device)
                tensors.append(staged)
                scatter.append((pages[:, heads[1]:heads[1] + heads[2]], staged))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if nbytes != header.nbytes:
        raise RefusedHeader(f"payload of {header.nbytes} bytes does not match the {nbytes} bytes its runs cover")
    return DestinationPlan(tensors, scatter)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view (dtype-agnostic transports; numpy has no bfloat16)."""
    return t.reshape(-1).view(torch.uint8)
