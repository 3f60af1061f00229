"""The data-plane backend interface: what a ``KVManager`` needs from a way of moving KV bytes.

How a backend is driven
-----------------------
* One backend instance per ``KVManager`` (one per scheduler rank), built as ``Cls(args, config, mode, events,
  local)`` through ``kvtransfer.registry``. ``mode`` is "prefill" (moves bytes out) or "decode" (bytes land in its
  buffers); ``local`` is this rank's own ``PeerKey`` (what the peers know it as, e.g. to name a data connection).
* ``endpoint()`` is called once after construction; the returned strings travel to peers inside the control-plane
  handshake (``Hello``/``HelloAck``) and come back to the peer's backend as ``PeerInfo.endpoint``.
* ``add_peer(peer)`` is called on both sides when a handshake with a peer epoch succeeds, before any job for it;
  ``remove_peer(key)`` when that peer dies, restarts (new epoch) or the manager closes.
* Prefill only: ``submit(job)`` once per (chunk, destination rank), from the scheduler thread. It must not block:
  queue the job and move it on a backend thread. Jobs to one peer complete in submission order.
* Completion: the backend calls ``events.on_job_done(job, error)`` **exactly once per submitted job**, from a
  backend thread (never from inside ``submit``/``cancel_room``), and only when the job's bytes are in the
  destination memory (``error=None``) or the job is known not to have completed (``error`` names the peer and the
  cause). Two-sided transports therefore need the destination's confirmation before reporting success.
* ``cancel_room(room)``: queued jobs of that room finish with an error without moving; jobs already moving
  finish normally. The manager sends ``AbortAck`` once every job of the room is done, which is what lets decode
  reuse the pages: after the last ``on_job_done`` of a room nothing may write to its destination pages.
* A job may have no runs (an empty last chunk); it completes in order like any other.
* Landing signals (``job.signal``: the decode rank reads this backend's signals, ``backends/signals.py``): a backend
  that has a signal ring for the peer may call ``events.on_job_enqueued(job, seq)`` once the job's copy is enqueued
  with signal ``seq`` set behind it (before ``on_job_done``, from the same worker); the decode rank's
  ``signal_reader(prefill key)`` then tells when ``seq`` landed. ``on_job_done`` keeps its meaning (bytes landed).
  A backend without signals ignores ``job.signal``.
* Decode side: ``submit`` is never called. A two-sided backend receives what the prefill peer sends and writes
  it into ``args`` buffers at the pages and heads the job describes (it may trust only pages in
  [1, num_pages) and heads in [0, kv_heads)); a one-sided backend exposes its buffers through ``endpoint()``.
* Thread-safety: methods may be called from the scheduler thread and the manager's control thread at once.
  ``poll()`` never reaches the backend; the scheduler only sees states derived from ``on_job_done``.

Byte layout: page p of layer l's K buffer is bytes [p*item_len, (p+1)*item_len) of ``args.k_buffers[l]`` (same for
V). A job covers every layer, K then V; ``job.heads`` is None when source and destination pages have the same
layout (whole pages move), else a ``HeadSlice`` (heterogeneous TP: only those heads of each slot move).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvtransfer.args import KVArgs, KVLayout, KVTransferConfig, Mode
from kvtransfer.pages import HeadSlice, PageRun


@dataclass(frozen=True, slots=True)
class PeerKey:
    """One start of one peer rank."""

    instance_id: str
    epoch: int


@dataclass(frozen=True)
class PeerInfo:
    key: PeerKey
    layout: KVLayout
    endpoint: dict[str, str]
    # This pairing: the same on both sides and new at every handshake, also when the same peer start handshakes
    # again after a stall (``auth.pairing_id``; "" where no handshake made it). A backend whose data connection is
    # named in shared state (nccl's group prefix in the decode's store) names it with this, never reusing a name.
    pairing: str = ""


@dataclass(frozen=True)
class TransferJob:
    """Move ``runs`` (source page -> destination page, all layers, K and V) of one chunk of ``room`` to ``peer``."""

    room: int
    chunk_id: int
    peer: PeerKey
    runs: tuple[PageRun, ...]
    heads: HeadSlice | None = None
    signal: bool = False  # the peer reads landing signals: announce the job once enqueued (see the module docstring)

    @property
    def num_pages(self) -> int:
        return sum(run.num_pages for run in self.runs)


class BackendEvents(Protocol):
    def on_job_done(self, job: TransferJob, error: str | None) -> None:
        """The job's bytes are in the destination (error None) or the job failed (error says why)."""

    def on_job_enqueued(self, job: TransferJob, signal: int) -> None:
        """The job's copy is enqueued; the peer's landing signal ``signal`` is set once it landed."""


class KVBackend(ABC):
    """Moves KV pages between one prefill rank and its decode peers. See the module docstring for the contract."""

    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        self.args = args
        self.local = local
        self.config = config
        self.mode = mode
        self.events = events

    @abstractmethod
    def endpoint(self) -> dict[str, str]:
        """What a peer's backend needs to reach this rank's data plane (addresses, segment names)."""

    @abstractmethod
    def add_peer(self, peer: PeerInfo) -> None:
        """Start talking to a peer that passed the handshake. May connect lazily; must not block long."""

    @abstractmethod
    def remove_peer(self, key: PeerKey) -> None:
        """Forget a peer: its queued and in-flight jobs finish with an error; its connections/mappings close."""

    def peer_endpoint(self, key: PeerKey) -> dict[str, str]:
        """Prefill, after ``add_peer(key)``: what only that peer gets (its landing signals), sent in its HelloAck."""
        return {}

    def signal_reader(self, key: PeerKey) -> Callable[[int], bool] | None:
        """Decode: ``landed(seq)`` of the landing signals prefill peer ``key`` exported (raises ``TransferError``
        when ``seq`` will never land), or None when there are none (then ChunkDone follows the landing)."""
        return None

    @abstractmethod
    def submit(self, job: TransferJob) -> None:
        """Prefill: queue one job; never blocks on I/O. Completion comes through ``events.on_job_done``."""

    @abstractmethod
    def cancel_room(self, room: int) -> None:
        """Queued jobs of ``room`` finish with an error without moving; jobs already moving finish normally."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads and release resources; outstanding jobs finish with an error. Idempotent."""
