"""``TPGroup``: the tensor-parallel group of one scheduler rank (torch.distributed).

A node runs ``dp_size x tp_size`` rank processes; the ``tp_size`` ranks of one DP replica form a group with two
process groups over one rendezvous (a ``TCPStore`` at ``--dist-init-addr``, one key prefix per DP replica):

    device_group  the model's collectives (all-reduce after row-parallel layers, logits all-gather):
                  NCCL on CUDA, gloo on CPU. Used by the forward, which may run on a worker thread.
    cpu_group     gloo, the scheduler's collectives: inputs broadcast from TP rank 0 (``broadcast_bytes``), the
                  MIN of KV transfer states (``all_reduce_min``), the KV pool size. Used by the scheduler thread.

Invariant: every rank of a group issues the same collectives in the same order on each process group, so a
collective is never shared between two threads (the two groups exist for exactly that). ``tp_size == 1`` has
no process group at all and every method is a local no-op, so single-rank code pays nothing.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist

from common.engine.io_struct import SchedulerInput
from common.errors import ConfigError

_inputs_encoder = msgspec.msgpack.Encoder()
_inputs_decoder = msgspec.msgpack.Decoder(list[SchedulerInput])


@dataclass
class TPGroup:
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    comm_seconds: float = 0.0  # wall time in the model's collectives (incl. waiting for the slowest rank)

    @property
    def is_leader(self) -> bool:
        """TP rank 0: receives the node's inputs and alone sends outputs to the front."""
        return self.tp_rank == 0

    # -- model collectives (device_group) --------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group in place (the row-parallel reduction); returns ``t``."""
        if self.tp_size > 1:
            t0 = time.perf_counter()
            dist.all_reduce(t, group=self.device_group)
            self.comm_seconds += time.perf_counter() - t0
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` in rank order (the vocab-parallel logits)."""
        if self.tp_size == 1:
            return t
        t0 = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.device_group)
        self.comm_seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=dim)

    # -- scheduler collectives (cpu_group) -------------------------------------------------------------------------
    def broadcast_bytes(self, data: bytes) -> bytes:
        """TP rank 0's ``data`` on every rank (SGLang's ``broadcast_pyobj``, over msgpack frames, never pickle:
        the group's sockets are not authenticated); other ranks pass ``b""``."""
        if self.tp_size == 1:
            return data
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        n = int(size.item())
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_leader else torch.empty(n, dtype=torch.uint8)
        if n:
            dist.broadcast(buf, src=0, group=self.cpu_group)
        return data if self.is_leader else buf.numpy().tobytes()

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise MIN of a CPU int64 tensor over the group, in place (KVPoll states, pool sizes)."""
        if self.tp_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return t

    def destroy(self) -> None:
        if self.tp_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.device_group = self.cpu_group = None


def broadcast_inputs(tp: TPGroup, msgs: list[SchedulerInput]) -> list[SchedulerInput]:
    """TP rank 0's inputs of this step on every rank of the group, so every rank steps on the same messages."""
    if tp.tp_size == 1:
        return msgs
    data = tp.broadcast_bytes(_inputs_encoder.encode(msgs) if tp.is_leader else b"")
    return msgs if tp.is_leader else _inputs_decoder.decode(data)


def init_tp_group(
    *, dist_init_addr: str, dp_rank: int, tp_rank: int, tp_size: int, device: torch.device, timeout_s: float,
) -> TPGroup:
    """Join DP replica ``dp_rank``'s TP group through the ``TCPStore`` at ``dist_init_addr`` ("host:port").

    ``is_store_master``: this process hosts the store (one per node group: the front, or the first rank when no
    front does). Every rank of the group must call this; it returns once all ``tp_size`` ranks joined, or raises
    after ``timeout_s``.
    """
    if tp_size == 1:
        return TPGroup(0, 1, dp_rank)
    host, _, port = dist_init_addr.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--dist-init-addr must be HOST:PORT, got {dist_init_addr!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore(f"pdcluster/dp{dp_rank}", store)
    backend = "nccl" if device.type == "cuda" else "gloo"
    options: dict[str, object] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=prefixed, rank=tp_rank, world_size=tp_size, timeout=timeout, **options)
    device_group = dist.group.WORLD
    # NOTE: a second gloo group even on CPU, so the scheduler thread's collectives never interleave with the
    # forward's (the prefill node runs forwards on a worker thread).
    cpu_group = dist.new_group(list(range(tp_size)), backend="gloo", timeout=timeout)
    return TPGroup(tp_rank, tp_size, dp_rank, device_group, cpu_group)


def host_store(dist_init_addr: str, timeout_s: float) -> dist.TCPStore:
    """Serve the rendezvous store of a node's TP groups at ``dist_init_addr``; keep the object alive while they run."""
    host, _, port = dist_init_addr.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--dist-init-addr must be HOST:PORT, got {dist_init_addr!r}")
    try:
        return dist.TCPStore(host, int(port), is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"cannot serve the TP rendezvous at --dist-init-addr {dist_init_addr}: {e}") from e
