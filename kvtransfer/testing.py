"""KV transfer test and benchmark support for ``tests/`` and ``benchmarks/`` (no serving process imports it):
synthetic pools, room plans, and a prefill/decode role run in a child process.

A child is started with multiprocessing "spawn" and scripted by a picklable ``RoleSpec``; it reports on a queue.
Tests kill only their own children, by PID, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from kvtransfer.args import KVArgs, KVTransferConfig
from kvtransfer.metadata import MetadataRecord
from kvtransfer.poll import KVPoll

PAGE_SIZE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
PREFILL_SEED = 1234
DECODE_SEED = 99
TOKEN = "test-cluster-token"
OPTIONAL_ENGINES = {"mooncake": "kvtransfer.backends.mooncake"}  # backend -> its module that loads the package


def _engine_missing(backend: str) -> str:
    """Why ``backend``'s optional engine cannot load here ("" when it can or the backend needs none)."""
    module = OPTIONAL_ENGINES.get(backend)
    if module is None:
        return ""
    try:
        importlib.import_module(module)
    except (ImportError, OSError) as exc:  # OSError: a shared library it links (libibverbs1) is missing
        return f"{backend}: {module} does not load ({exc}); `make install` installs it"
    return ""


def backend_param(backend: str, *values: object) -> object:
    """``backend`` (and the case's other ``values``) as a pytest parameter, skipped only when the backend's optional
    engine package cannot load."""
    import pytest  # the test extra; benchmarks use this module without it
    missing = _engine_missing(backend)
    return pytest.param(backend, *values, marks=pytest.mark.skipif(bool(missing), reason=missing))


def make_args(
    seed: int,
    num_pages: int,
    *,
    page_size: int = PAGE_SIZE,
    layers: int = LAYERS,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_heads: int | None = None,
    device: str = "cpu",
    draft: tuple[int, int, int] | None = None,
) -> KVArgs:
    """Random per-layer K/V pools (page 0 included), reproducible from ``seed`` (the same values on any device).
    ``draft`` (layers, heads, head_dim): that many more layers of their own geometry (a draft model's, with
    ``heads * tp_size`` heads in all), as leading slices of larger tensors (a draft pool's headroom after them)."""
    g = torch.Generator().manual_seed(seed)
    slots = (num_pages + 1) * page_size

    def buf(h: int = heads, d: int = head_dim, extra: int = 0) -> torch.Tensor:
        t = torch.randn(slots + extra, h, d, generator=g).to(torch.bfloat16).to(device)
        return t[:slots] if extra else t

    dl, dh, dd = draft or (0, 0, 0)
    ks = tuple(buf() for _ in range(layers)) + tuple(buf(dh, dd, page_size) for _ in range(dl))
    vs = tuple(buf() for _ in range(layers)) + tuple(buf(dh, dd, page_size) for _ in range(dl))
    total = total_heads or heads * tp_size
    return KVArgs(
        ks,
        vs,
        page_size=page_size,
        total_kv_heads=total,
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_metadata_slots=128,
        layer_total_kv_heads=(total,) * layers + (dh * tp_size,) * dl,
    )


def kv_config(backend: str, **overrides: object) -> KVTransferConfig:
    base = KVTransferConfig(
        backend=backend,
        cluster_token=TOKEN,
        bootstrap_timeout_s=10,
        waiting_timeout_s=10,
        transfer_timeout_s=10,
        abort_ack_timeout_s=2,
        heartbeat_interval_s=0.2,
        # A peer is lost after 2 s of silence: on the 2-core CI host under the whole suite, a process was seen
        # unscheduled (or its control thread starved) for over 1 s, and two live peers dropped each other.
        heartbeat_misses=10,
        fingerprint={"architecture": "TinyLlama", "weights": "abc"},
    )
    return replace(base, **overrides)


@dataclass(frozen=True)
class RoomPlan:
    room: int
    src_pages: list[int]
    dst_pages: list[int]
    chunks: list[int]  # pages per chunk, summing to len(src_pages)
    slot: int

    def metadata(self) -> MetadataRecord:
        return MetadataRecord(
            room=self.room,
            first_token=self.room % 1000,
            logprob=-0.25,
            cached_tokens=3,
            top_ids=(1, 2),
            top_logprobs=(-0.25, -2.0),
        )


def plan_rooms(
    n: int, src_pool_pages: int, dst_pool_pages: int, pages_per_room: int, seed: int = 0, max_chunks: int = 3
) -> list[RoomPlan]:
    """``n`` rooms with random, non-contiguous, disjoint source and destination pages (runs of 1-3 pages)."""
    rng = random.Random(seed)
    src_free = list(range(1, src_pool_pages + 1))
    dst_free = list(range(1, dst_pool_pages + 1))
    rng.shuffle(src_free)
    rng.shuffle(dst_free)
    plans = []
    for i in range(n):
        src = [src_free.pop() for _ in range(pages_per_room)]
        dst = [dst_free.pop() for _ in range(pages_per_room)]
        src[1:3] = sorted(src[1:3])  # give some runs a chance to be contiguous on the source side
        cuts = sorted(rng.sample(range(1, pages_per_room), min(max_chunks, pages_per_room) - 1))
        chunks = [b - a for a, b in zip([0, *cuts], [*cuts, pages_per_room], strict=True)]
        plans.append(
            RoomPlan(room=(i + 1) * 7919 + seed, src_pages=src, dst_pages=dst, chunks=chunks, slot=i)
        )
    return plans


@dataclass(frozen=True)
class RoleSpec:
    role: str  # "prefill" | "decode"
    backend: str
    rooms: list[RoomPlan]
    num_pages: int = 64
    bootstrap_addr: str = ""  # decode: where to resolve; prefill: ignored (it starts its own server)
    bootstrap_port: int = 0
    config_overrides: dict[str, object] = field(default_factory=dict)
    args_overrides: dict[str, object] = field(default_factory=dict)
    drop_final_chunk_done: bool = False  # fault: prefill never sends the last ChunkDone
    pause_after_chunks: int = (
        -1
    )  # prefill: after this many chunk sends, stop sending (to be killed mid-transfer)
    abort_rooms: list[int] = field(default_factory=list)  # abort these rooms once they are WaitingForInput
    linger_s: float = 30.0


def drive_senders(
    mgr,
    plans: list[RoomPlan],
    deadline_s: float,
    pause_after_chunks: int = -1,
    abort_rooms: list[int] | None = None,
) -> dict[int, tuple[int, str]]:
    """Run prefill senders for ``plans``, one chunk per room per round (rooms interleave); returns final states."""
    from kvtransfer.sender import KVSender

    senders = {p.room: KVSender(mgr, p.room) for p in plans}
    progress = {p.room: 0 for p in plans}
    sent_chunks = 0
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        busy = False
        for plan in plans:
            sender = senders[plan.room]
            state = sender.poll()
            if state.is_final:
                continue
            busy = True
            if state < KVPoll.WaitingForInput:
                continue
            if plan.room in (abort_rooms or ()):
                sender.abort("test abort")
                continue
            k = progress[plan.room]
            if k == 0 and state == KVPoll.WaitingForInput:
                sender.init(len(plan.src_pages), plan.slot)
            if k < len(plan.chunks) and sent_chunks != pause_after_chunks:
                start = sum(plan.chunks[:k])
                last = k == len(plan.chunks) - 1
                sender.send(
                    plan.src_pages[start : start + plan.chunks[k]],
                    last=last,
                    metadata=plan.metadata() if last else None,
                )
                progress[plan.room] += 1
                sent_chunks += 1
        if not busy:
            break
        time.sleep(0.002)
    return {room: (int(s.poll()), s.failure()) for room, s in senders.items()}


def start_receivers(mgr, plans: list[RoomPlan], bootstrap_addr: str) -> dict:
    from kvtransfer.receiver import KVReceiver

    receivers = {}
    for plan in plans:
        receiver = KVReceiver(mgr, plan.room, bootstrap_addr)
        receiver.init(0)
        receiver.send_metadata(plan.dst_pages, plan.slot)
        receivers[plan.room] = receiver
    return receivers


def wait_final(handles: dict, deadline_s: float) -> dict[int, tuple[int, str]]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and not all(h.poll().is_final for h in handles.values()):
        time.sleep(0.005)
    return {room: (int(h.poll()), h.failure()) for room, h in handles.items()}


def _role_main(spec: RoleSpec, out: mp.Queue) -> None:
    from kvtransfer.bootstrap import BootstrapServer
    from kvtransfer.decode_rooms import DecodeRooms
    from kvtransfer.manager import KVManager
    from kvtransfer.prefill_rooms import PrefillRooms

    config = kv_config(spec.backend, **spec.config_overrides)
    if spec.role == "prefill":
        if spec.drop_final_chunk_done:
            _drop_final_chunk_done()
        server = BootstrapServer(config.cluster_token)
        port = server.start("127.0.0.1", spec.bootstrap_port)
        args = make_args(PREFILL_SEED, spec.num_pages, **spec.args_overrides)
        mgr = KVManager(args, config, PrefillRooms, bootstrap_addr=f"127.0.0.1:{port}")
        out.put(("ready", port, mgr.control.address, mgr.instance_id, mgr.epoch))
        result = drive_senders(mgr, spec.rooms, 60.0, spec.pause_after_chunks, spec.abort_rooms)
    else:
        args = make_args(DECODE_SEED, spec.num_pages, **spec.args_overrides)
        mgr = KVManager(args, config, DecodeRooms)
        out.put(("ready", 0, mgr.control.address, mgr.instance_id, mgr.epoch))
        receivers = start_receivers(mgr, spec.rooms, spec.bootstrap_addr)
        result = wait_final(receivers, 60.0)
    quiesced = _wait_quiesced(mgr, 5.0)
    out.put(("result", result, quiesced))
    time.sleep(spec.linger_s)
    mgr.close()


def _wait_quiesced(mgr, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with mgr.lock:
            if all(r.quiesced for r in mgr.rooms.rooms.values()):
                return True
        time.sleep(0.01)
    return False


def _drop_final_chunk_done() -> None:
    """Fault injection in the child: the control plane silently drops the last ChunkDone of every room."""
    from kvtransfer import control
    from kvtransfer.messages import ChunkDone

    original = control.ControlPlane.send

    def send(self, addr, msg, session=None):
        if isinstance(msg, ChunkDone) and msg.num_chunks:
            return
        original(self, addr, msg, session)

    control.ControlPlane.send = send


def wait_restart_noticeable(mgr, instance_id: str, timeout_s: float = 5.0) -> None:
    """Returns once ``mgr`` has heard nothing from prefill ``instance_id`` for the suspicion window (receiver's
    ``SUSPECT_HEARTBEATS``), so that a room made now looks the rank up afresh. A node's restart takes seconds; a
    harness child restarts in a fraction of one, and a room made sooner would bind to the dead start and fail with
    it."""
    from kvtransfer.decode_rooms import SUSPECT_HEARTBEATS

    window = (SUSPECT_HEARTBEATS + 0.5) * mgr.config.heartbeat_interval_s
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with mgr.lock:
            peer = mgr.peers.get(instance_id)
            if peer is None or time.monotonic() - peer.last_seen > window:
                return
        time.sleep(0.02)
    raise AssertionError(f"{instance_id} still heard from {timeout_s} s after it was killed")


def _child_context() -> mp.context.BaseContext:
    """Role processes fork from a server that has imported torch and this module once (a spawned child would pay
    ~3 s of CPU importing them, the bulk of a fault test's cost). The server is started before any backend library
    is loaded or any thread runs in it, so each fork starts as clean as a spawn; it sees the environment of the
    moment it started."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class Child:
    """A role process. ``kill()``/``stop()`` act on this child's PID only."""

    def __init__(self, spec: RoleSpec) -> None:
        ctx = _child_context()
        self.out: mp.Queue = ctx.Queue()
        self.proc = ctx.Process(target=_role_main, args=(spec, self.out), daemon=True)
        self.proc.start()
        _, self.bootstrap_port, self.control_addr, self.instance_id, self.epoch = self.expect("ready", 60)

    @property
    def bootstrap_addr(self) -> str:
        return f"127.0.0.1:{self.bootstrap_port}"

    def expect(self, kind: str, timeout_s: float) -> tuple:
        msg = self.out.get(timeout=timeout_s)
        assert msg[0] == kind, msg
        return msg

    def result(self, timeout_s: float = 60) -> tuple[dict[int, tuple[int, str]], bool]:
        _, result, quiesced = self.expect("result", timeout_s)
        return result, quiesced

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        # NOTE: the forkserver, not this process, reaps the child: is_alive() may still say True after it died and
        # its pid was freed (a test that killed it already, a role that exited).
        if self.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


def transfer_interleaved_rooms(backend: str, config_overrides: dict[str, object] | None = None, *, seed: int,
                               num_pages: int = 64 * 5 + 16, prefill_device: str = "cpu", decode_device: str = "cpu",
                               check: Callable[[object], None] | None = None) -> None:
    """64 interleaved chunked rooms, prefill in a child process on ``prefill_device``, decode here: every room
    succeeds on both sides and quiesces, its metadata arrives, every destination page is byte-exact and no other page
    is touched. ``check(decode_manager)`` runs as soon as every room has landed, while the prefill child lingers
    (the byte comparisons after it hold this process's GIL for seconds: on a loaded machine the child may declare
    this side silent meanwhile and drop its connections)."""
    from kvtransfer.decode_rooms import DecodeRooms
    from kvtransfer.manager import KVManager

    overrides = config_overrides or {}
    plans = plan_rooms(64, num_pages, num_pages, pages_per_room=5, seed=seed)
    child = Child(RoleSpec("prefill", backend, plans, num_pages=num_pages, config_overrides=overrides,
                           args_overrides={"device": prefill_device}, linger_s=5))
    args = make_args(DECODE_SEED, num_pages, device=decode_device)
    mgr = KVManager(args, kv_config(backend, **overrides), DecodeRooms)
    try:
        before = [b.cpu() for b in (*args.k_buffers, *args.v_buffers)]
        receivers = start_receivers(mgr, plans, child.bootstrap_addr)
        result = wait_final(receivers, 60)
        assert all(state == KVPoll.Success for state, _ in result.values()), result
        if check is not None:
            check(mgr)
        prefill_result, quiesced = child.result()
        assert all(state == KVPoll.Success for state, _ in prefill_result.values()) and quiesced, prefill_result
        src = make_args(PREFILL_SEED, num_pages)
        ps = args.page_size
        written = {d for plan in plans for d in plan.dst_pages}
        for s, d, old in zip((*src.k_buffers, *src.v_buffers), (*args.k_buffers, *args.v_buffers), before,
                             strict=True):
            d = d.cpu()
            for plan in plans:
                assert receivers[plan.room].metadata() == plan.metadata()
                for sp, dp in zip(plan.src_pages, plan.dst_pages, strict=True):
                    assert torch.equal(d[dp * ps:(dp + 1) * ps], s[sp * ps:(sp + 1) * ps]), (plan.room, sp, dp)
            for page in set(range(args.num_pages)) - written:
                assert torch.equal(d[page * ps:(page + 1) * ps], old[page * ps:(page + 1) * ps]), f"page {page}"
        for receiver in receivers.values():
            receiver.clear()
    finally:
        mgr.close()
        child.kill()
