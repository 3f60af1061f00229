"""What a scheduler rank registers for KV transfer (``KVArgs``), its serializable summary (``KVLayout``), the
transfer config, and the compatibility check run at the first handshake between a decode and a prefill rank.

Buffer layout (one K and one V tensor per layer, see ``common/engine/mem/kv_pool.py``)::

    k_buffers[layer]: [ page 0 (pad) | page 1 | ... ]   page p = slots [p*page_size, (p+1)*page_size)
                      = bytes [p*item_len, (p+1)*item_len) of the layer's buffer
    one slot: [kv_heads, head_dim]   (kv_heads = this TP rank's share of total_kv_heads)

Layer groups: the layers may fall in groups of different slot geometry (a STANDALONE draft model's layers after the
target's: their own KV heads, head dim and total heads), all with the target's slot numbering, page size and dtype.
Group 0 (the first layers, the target's, and what shares their geometry, an EAGLE head) is what ``KVLayout``'s own
fields describe; each further group is a ``KVGroup`` in ``KVLayout.extra``. A backend moves one group's buffers
(``group_args``); ``backends.grouped`` runs one backend per group and a job over all of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import msgspec
import torch

from common import env
from common.kv_backends import check_options
from kvtransfer.pages import HeadSlice

if TYPE_CHECKING:
    from common.engine.mem.kv_pool import MHATokenToKVPool

Mode = Literal["prefill", "decode"]


class KVGroup(msgspec.Struct, frozen=True):
    """The geometry of a further layer group (module docstring)."""

    num_layers: int
    total_kv_heads: int
    kv_heads: int
    head_dim: int
    item_len: int


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's KV geometry and model identity, sent at the handshake (the compatibility fingerprint)."""

    model: dict[str, str]  # KVTransferConfig.fingerprint: architecture, weights hash, ...
    num_layers: int
    total_kv_heads: int  # heads of the whole model
    kv_heads: int  # heads held by this rank
    head_dim: int
    dtype: str  # e.g. "torch.bfloat16"
    page_size: int
    item_len: int  # bytes of one page of one layer's K (or V)
    num_pages: int  # pages per layer buffer, padding page 0 included
    tp_rank: int
    tp_size: int
    dp_rank: int
    extra: list[KVGroup] = []  # further layer groups (their own slot geometry), in layer order

    def describe(self) -> str:
        """One line naming the layout, for handshake errors."""
        extra = "".join(f" + {g.num_layers} layers of {g.kv_heads} of {g.total_kv_heads} KV heads x {g.head_dim}"
                        for g in self.extra)
        return (f"dp {self.dp_rank} tp {self.tp_rank}/{self.tp_size}: {self.kv_heads} of {self.total_kv_heads} KV "
                f"heads x {self.head_dim}, {self.num_layers} layers{extra}, page {self.page_size}, {self.dtype}")

    def group(self, g: int) -> KVLayout:
        """Layer group ``g``'s layout in group 0's fields (what one group's backend sees of its peer)."""
        if g == 0:
            return msgspec.structs.replace(self, extra=[])
        e = self.extra[g - 1]
        return msgspec.structs.replace(self, num_layers=e.num_layers, total_kv_heads=e.total_kv_heads,
                                       kv_heads=e.kv_heads, head_dim=e.head_dim, item_len=e.item_len, extra=[])


@dataclass(frozen=True, eq=False)
class KVArgs:
    """One rank's KV buffers and geometry. Tensors may be CPU or CUDA; every buffer is contiguous and equal-sized."""

    k_buffers: tuple[torch.Tensor, ...]
    v_buffers: tuple[torch.Tensor, ...]
    page_size: int
    total_kv_heads: int
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    num_metadata_slots: int = 256
    layer_ids: tuple[int, ...] = ()  # global layer ids; default 0..num_layers-1
    draft_state_dims: tuple[int, int] = (0, 0)  # EAGLE: (topk, hidden) of the draft state metadata carries
    layer_total_kv_heads: tuple[int, ...] = ()  # per layer (layer groups); default total_kv_heads for every layer

    def __post_init__(self) -> None:
        if not self.k_buffers or len(self.k_buffers) != len(self.v_buffers):
            raise ValueError("KVArgs needs one K and one V buffer per layer")
        first = self.k_buffers[0]
        for k, v in zip(self.k_buffers, self.v_buffers, strict=True):
            for buf in (k, v):
                if buf.shape != k.shape or buf.shape[0] != first.shape[0] or buf.dtype != first.dtype \
                        or not buf.is_contiguous():
                    raise ValueError("all KV buffers must be contiguous with one dtype and slot count, a layer's K "
                                     "and V of one shape")
        if first.dim() != 3 or first.shape[0] % self.page_size:
            raise ValueError(f"KV buffers must be [num_slots, kv_heads, head_dim] with page_size | num_slots, got "
                             f"{tuple(first.shape)} and page_size={self.page_size}")
        if not self.layer_ids:
            object.__setattr__(self, "layer_ids", tuple(range(len(self.k_buffers))))
        if not self.layer_total_kv_heads:
            object.__setattr__(self, "layer_total_kv_heads", (self.total_kv_heads,) * len(self.k_buffers))
        if len(self.layer_total_kv_heads) != len(self.k_buffers):
            raise ValueError("layer_total_kv_heads needs one entry per layer")

    def groups(self) -> list[range]:
        """The layer groups: maximal runs of layers with one slot geometry and total heads, in order."""
        def key(i: int) -> tuple[object, ...]:
            return (*self.k_buffers[i].shape[1:], self.layer_total_kv_heads[i])

        starts = [i for i in range(len(self.k_buffers)) if i == 0 or key(i) != key(i - 1)]
        return [range(a, b) for a, b in zip(starts, [*starts[1:], len(self.k_buffers)], strict=True)]

    def group_args(self, g: int) -> KVArgs:
        """Layer group ``g`` alone (one geometry: what one backend moves)."""
        layers = self.groups()[g]
        return dataclasses.replace(
            self, k_buffers=self.k_buffers[layers.start:layers.stop], v_buffers=self.v_buffers[layers.start:layers.stop],
            total_kv_heads=self.layer_total_kv_heads[layers.start], layer_ids=self.layer_ids[layers.start:layers.stop],
            layer_total_kv_heads=self.layer_total_kv_heads[layers.start:layers.stop])

    @classmethod
    def from_pool(cls, pool: MHATokenToKVPool, *, tp_rank: int = 0, tp_size: int = 1, dp_rank: int = 0,
                  total_kv_heads: int | None = None, num_metadata_slots: int = 256,
                  extra_layers: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                  draft_state_dims: tuple[int, int] = (0, 0), extra_total_kv_heads: int = 0) -> KVArgs:
        """KVArgs over an ``MHATokenToKVPool`` (its tensors are shared, not copied). ``extra_layers``: (K, V) buffers
        with the pool's slot numbering that travel after its layers (an EAGLE head's KV, a STANDALONE draft's), of
        ``extra_total_kv_heads`` KV heads in all (0: the pool's)."""
        total = total_kv_heads or pool.num_kv_heads * tp_size
        return cls(k_buffers=(*pool.k_buffer, *(k for k, _ in extra_layers)),
                   v_buffers=(*pool.v_buffer, *(v for _, v in extra_layers)), page_size=pool.page_size,
                   total_kv_heads=total, tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank,
                   num_metadata_slots=num_metadata_slots, draft_state_dims=draft_state_dims,
                   layer_total_kv_heads=(total,) * pool.num_layers + (extra_total_kv_heads or total,) * len(extra_layers))

    @property
    def num_layers(self) -> int:
        """Layers of group 0 (all of them when the layers share one geometry)."""
        return len(self.groups()[0])

    @property
    def kv_heads(self) -> int:
        return self.k_buffers[0].shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_buffers[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_buffers[0].dtype

    @property
    def num_pages(self) -> int:
        """Pages per layer buffer, including the padding page 0."""
        return self.k_buffers[0].shape[0] // self.page_size

    @property
    def item_len(self) -> int:
        """Bytes of one page of one layer's K (or V) buffer."""
        return self.page_size * self.kv_heads * self.head_dim * self.k_buffers[0].element_size()

    @property
    def model_bytes_per_page(self) -> int:
        """Bytes one page of every layer's K and V takes for the whole model (each layer's total KV heads, not this
        rank's): what a transfer moves per page over all TP ranks, a draft's layers (``from_pool``'s
        ``extra_layers``, in every layer group) included."""
        return sum(2 * self.page_size * total * k.shape[2] * k.element_size()
                   for k, total in zip(self.k_buffers, self.layer_total_kv_heads, strict=True))

    def layout(self, model: Mapping[str, str]) -> KVLayout:
        extra = [KVGroup(len(layers), a.total_kv_heads, a.kv_heads, a.head_dim, a.item_len)
                 for layers, a in ((r, self.group_args(g)) for g, r in enumerate(self.groups()) if g)]
        return KVLayout(model=dict(model), num_layers=self.num_layers, total_kv_heads=self.total_kv_heads,
                        kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=str(self.dtype),
                        page_size=self.page_size, item_len=self.item_len, num_pages=self.num_pages,
                        tp_rank=self.tp_rank, tp_size=self.tp_size, dp_rank=self.dp_rank, extra=extra)


@dataclass(frozen=True)
class KVTransferConfig:
    """KV transfer settings of one process; per-rank variants via ``dataclasses.replace``.

    Deadlines (seconds) bound every non-final state: Bootstrapping (resolve + handshake, or waiting for the decode's
    TransferInfo), WaitingForInput (waiting for the first chunk), Transferring (longest gap without progress).
    A peer that sends nothing for ``heartbeat_interval_s * heartbeat_misses`` is declared dead.
    """

    backend: str = "tcp"
    cluster_token: str = field(default_factory=env.cluster_token, repr=False)
    host: str = "127.0.0.1"  # bind address of the control and data listeners
    advertise_host: str = ""  # the address written into endpoints peers connect to; "" = host
    control_port: int = 0  # 0 = ephemeral; fixed ports let a restarted rank come back on the same address
    bootstrap_timeout_s: float = 30.0
    waiting_timeout_s: float = 60.0
    transfer_timeout_s: float = 60.0
    abort_ack_timeout_s: float = 5.0  # after an abort, how long to wait for the peer's ack before reusing pages
    heartbeat_interval_s: float = 1.0
    heartbeat_misses: int = 5
    tombstone_s: float = 120.0  # how long a finished room's id is remembered (late messages are dropped)
    fingerprint: Mapping[str, str] = field(default_factory=dict)  # model identity, see model_fingerprint()
    backend_options: Mapping[str, str] = field(default_factory=dict)  # backend-specific, e.g. {"ucx_tls": ...}

    def __post_init__(self) -> None:
        if not self.cluster_token:
            raise ValueError("KVTransferConfig.cluster_token is empty: set PDCLUSTER_CLUSTER_TOKEN (the cluster "
                             "secret) on every node; there is no default")
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s", "abort_ack_timeout_s",
                     "heartbeat_interval_s", "tombstone_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVTransferConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_misses < 1:
            raise ValueError(f"KVTransferConfig.heartbeat_misses must be >= 1, got {self.heartbeat_misses}")
        check_options(self.backend, self.backend_options, "KVTransferConfig.backend_options")

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def peer_dead_after_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses


def model_fingerprint(architecture: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      weight_shapes: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """The model identity both sides must share; ``weights`` hashes the sorted (name, shape) list."""
    digest = hashlib.sha256()
    for name in sorted(weight_shapes):
        digest.update(f"{name}:{tuple(weight_shapes[name])}\n".encode())
    return {"architecture": architecture, "num_layers": str(num_layers), "num_kv_heads": str(num_kv_heads),
            "head_dim": str(head_dim), "dtype": str(dtype), "weights": digest.hexdigest()[:16]}


def incompatibility(prefill: KVLayout, decode: KVLayout) -> str | None:
    """The handshake's refusal reason naming every mismatch and both layouts, or None when compatible."""
    problems = compat_problems(prefill, decode)
    if not problems:
        return None
    return (f"incompatible KV layout: {'; '.join(problems)} (prefill {prefill.describe()}; decode "
            f"{decode.describe()})")


def compat_problems(prefill: KVLayout, decode: KVLayout) -> list[str]:
    """Every mismatch that makes a transfer between these ranks wrong, each naming both values; [] if compatible."""
    problems = []
    for key in sorted(set(prefill.model) | set(decode.model)):
        p, d = prefill.model.get(key, "<unset>"), decode.model.get(key, "<unset>")
        if p != d:
            hint = (" (both nodes need the same --speculative-algorithm and --speculative-draft-model-path)"
                    if key.startswith("draft_") else "")
            problems.append(f"model {key}: prefill={p} decode={d}{hint}")
    for name in ("num_layers", "total_kv_heads", "head_dim", "dtype", "page_size"):
        p, d = getattr(prefill, name), getattr(decode, name)
        if p != d:
            problems.append(f"{name}: prefill={p} decode={d}")
    for side, layout in (("prefill", prefill), ("decode", decode)):
        heads, tp = layout.total_kv_heads, layout.tp_size
        if (heads >= tp and heads % tp) or (heads < tp and tp % heads):
            problems.append(f"tp_size: {side}={tp} does not divide total_kv_heads={heads} "
                            f"(prefill tp_size={prefill.tp_size}, decode tp_size={decode.tp_size})")
    groups = [(g.num_layers, g.total_kv_heads, g.head_dim) for g in prefill.extra]
    if groups != [(g.num_layers, g.total_kv_heads, g.head_dim) for g in decode.extra]:
        problems.append(f"further layer groups (layers, KV heads, head dim): prefill={groups} decode="
                        f"{[(g.num_layers, g.total_kv_heads, g.head_dim) for g in decode.extra]}")
    elif prefill.extra and prefill.tp_size != decode.tp_size:
        # a head slice of the target's heads maps onto a group's heads when every rank's share scales alike
        heads = [prefill.total_kv_heads, *(g.total_kv_heads for g in prefill.extra)]
        if any(h % tp for h in heads for tp in (prefill.tp_size, decode.tp_size)):
            problems.append(f"KV heads {heads} of the layer groups (the target's, a draft model's) are not all "
                            f"divisible by tp_size prefill={prefill.tp_size} and decode={decode.tp_size}: start "
                            "both nodes with one --tp-size")
    return problems


def group_heads(heads: HeadSlice | None, total: int, group_total: int) -> HeadSlice | None:
    """A job's head slice of the target's ``total`` heads, as the slice of a layer group with ``group_total`` heads
    (exact: the handshake refused pairs whose ranks' shares do not scale alike)."""
    if heads is None or group_total == total:
        return heads
    return HeadSlice(heads.src_head * group_total // total, heads.dst_head * group_total // total,
                     heads.num_heads * group_total // total)
