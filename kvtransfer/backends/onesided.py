"""What the one-sided backends (``nixl``, ``mooncake``) share: a decode peer's registered pool as its endpoint
describes it, and the WRITE segments of a job (source address -> destination address, length).

Decode publishes, per buffer in payload order (K0, V0, K1, V1, ...), the address of byte 0 (``bases``) and the
buffer's size (``buffer_bytes``); the peer's layout (pages, heads, page bytes) comes from the control-plane
handshake. Segments are buffer-major: for buffer: for run (whole pages) or for token slot (head slices)::

    buffer b, whole pages:  src = local_bases[b] + src_page * item_len    dst = bases[b] + dst_page * item_len
                            length = num_pages * item_len                   (one segment per page run)
    buffer b, head slice:   one segment per token slot, num_heads * head_bytes long, at each side's head offset
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtransfer.args import KVArgs
from kvtransfer.backends.base import PeerInfo, TransferJob
from kvtransfer.backends.workers import TransferError


@dataclass(frozen=True)
class RemotePool:
    """A decode peer's registered KV buffers."""

    bases: np.ndarray  # uint64 address of each buffer, K0 V0 K1 V1 ...
    buffer_bytes: int
    num_pages: int
    kv_heads: int
    item_len: int

    @classmethod
    def of(cls, peer: PeerInfo, num_buffers: int) -> RemotePool:
        """From the peer's endpoint (``bases``, ``buffer_bytes``) and layout; raises KeyError/ValueError."""
        bases = np.array([int(b) for b in peer.endpoint["bases"].split(",")], dtype=np.uint64)
        if len(bases) != num_buffers:
            raise ValueError(f"the peer has {len(bases)} KV buffers, this rank {num_buffers}")
        return cls(bases, int(peer.endpoint["buffer_bytes"]), peer.layout.num_pages, peer.layout.kv_heads,
                   peer.layout.item_len)


def pool_endpoint(bases: np.ndarray, buffer_bytes: int) -> dict[str, str]:
    """Decode: what ``RemotePool.of`` reads back on the prefill side."""
    return {"bases": ",".join(str(int(b)) for b in bases), "buffer_bytes": str(buffer_bytes)}


def write_segments(args: KVArgs, local_bases: np.ndarray, element_size: int, pool: RemotePool,
                   job: TransferJob) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source addresses, destination addresses, lengths) of ``job``, uint64, buffer-major; raises TransferError
    when a destination page or head falls outside the peer's pool (nothing may be written then)."""
    if any(r.dst_page < 1 or r.dst_page + r.num_pages > pool.num_pages for r in job.runs):
        raise TransferError(f"destination pages of room {job.room} outside the peer's {pool.num_pages} pages")
    runs = np.array([(r.src_page, r.dst_page, r.num_pages) for r in job.runs], dtype=np.uint64).reshape(-1, 3)
    if job.heads is None:
        if pool.item_len != args.item_len:
            raise TransferError(f"page sizes differ ({args.item_len} vs {pool.item_len} bytes) without a head slice")
        src_off, dst_off, length = runs[:, 0] * args.item_len, runs[:, 1] * args.item_len, runs[:, 2] * args.item_len
    else:
        h = job.heads
        if h.dst_head + h.num_heads > pool.kv_heads or h.src_head + h.num_heads > args.kv_heads:
            raise TransferError(f"head slice {h} outside {args.kv_heads} source / {pool.kv_heads} peer heads")
        ps, head_bytes = args.page_size, args.head_dim * element_size
        s_slots = np.concatenate([np.arange(r.src_page * ps, (r.src_page + r.num_pages) * ps, dtype=np.uint64)
                                  for r in job.runs])
        d_slots = np.concatenate([np.arange(r.dst_page * ps, (r.dst_page + r.num_pages) * ps, dtype=np.uint64)
                                  for r in job.runs])
        src_off = s_slots * (args.kv_heads * head_bytes) + h.src_head * head_bytes
        dst_off = d_slots * (pool.kv_heads * head_bytes) + h.dst_head * head_bytes
        length = np.full(len(s_slots), h.num_heads * head_bytes, dtype=np.uint64)
    src = (local_bases[:, None] + src_off[None, :]).reshape(-1)
    dst = (pool.bases[:, None] + dst_off[None, :]).reshape(-1)
    return src, dst, np.tile(length, len(local_bases))
