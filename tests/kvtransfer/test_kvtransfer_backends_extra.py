"""The queued backends ``nccl`` (two-sided messages on gloo) and ``ucx`` (one-sided PUTs) beyond the shared suite;
the message-plan tests (packing, refusal by the destination) are ``nccl``'s alone (``ucx`` is in
test_kvtransfer_nixl.py's one-sided suite for those).

Driven directly through the ``KVBackend`` interface with recording events (prefill and decode backend in this
process, each on its own threads), plus the shared kill-mid-transfer faults across processes; and the head slice
of a layer group of its own geometry (``backends.grouped``) on the backends that run in one process.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from common.ports import pick_free_port
from kvtransfer.args import KVArgs
from kvtransfer.backends.base import KVBackend, PeerInfo, PeerKey, TransferJob
from kvtransfer.pages import HeadSlice, PageRun, coalesce_runs
from kvtransfer.poll import KVPoll
from kvtransfer.registry import backend_class
from kvtransfer.testing import (
    LAYERS,
    PAGE_SIZE,
    PREFILL_SEED,
    Child,
    RoleSpec,
    kv_config,
    make_args,
    plan_rooms,
    start_receivers,
    wait_final,
    wait_restart_noticeable,
)
from tests.kvtransfer import test_kvtransfer_faults as faults

BACKENDS = ["nccl", "ucx"]
TWO_SIDED = ["nccl"]
NUM_PAGES = 48


class Events:
    """Records ``on_job_done`` calls; fails the test on a second report of one job."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.done: list[tuple[TransferJob, str | None]] = []
        self.threads: set[str] = set()

    def on_job_done(self, job: TransferJob, error: str | None) -> None:
        with self.cond:
            assert all(j is not job for j, _ in self.done), f"job reported twice: {job}"
            self.done.append((job, error))
            self.threads.add(threading.current_thread().name)
            self.cond.notify_all()

    def wait(self, n: int, timeout_s: float = 20) -> list[tuple[TransferJob, str | None]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.done) >= n, timeout_s), f"{len(self.done)}/{n} jobs done"
            return list(self.done)


class Pair:
    """A prefill and a decode backend of one kind, handshaken with each other."""

    def __init__(self, backend: str, src: KVArgs, dst: KVArgs, **config: object) -> None:
        cls = backend_class(backend)
        cfg = kv_config(backend, **config)
        self.events, self.decode_events = Events(), Events()
        self.p_key, self.d_key = PeerKey("prefill/dp0/tp0", time.time_ns()), PeerKey("decode/dp0/tp0", time.time_ns())
        self.prefill: KVBackend = cls(src, cfg, "prefill", self.events, self.p_key)
        self.decode: KVBackend = cls(dst, cfg, "decode", self.decode_events, self.d_key)
        self.src, self.dst = src, dst
        p_info = PeerInfo(self.p_key, src.layout({}), self.prefill.endpoint())
        d_info = PeerInfo(self.d_key, dst.layout({}), self.decode.endpoint())
        self.prefill.add_peer(d_info)  # the prefill side accepts the Hello first
        self.decode.add_peer(p_info)

    def job(self, room: int, chunk: int, src_pages: list[int], dst_pages: list[int],
            heads: HeadSlice | None = None) -> TransferJob:
        return TransferJob(room, chunk, self.d_key, tuple(coalesce_runs(src_pages, dst_pages)), heads)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, no_threads_left: None) -> str:
    return request.param


def _pages(buf: torch.Tensor, page: int) -> torch.Tensor:
    return buf[page * PAGE_SIZE:(page + 1) * PAGE_SIZE]


# pack_bytes: one message per run / mixed (runs of >= 2 pages go direct, single pages are packed) / all packed
@pytest.mark.parametrize("pack", ["0", "1024", "4194304"])
@pytest.mark.parametrize("backend", TWO_SIDED)
def test_jobs_land_in_submission_order_and_empty_jobs_complete(backend: str, pack: str) -> None:
    pair = Pair(backend, make_args(1, NUM_PAGES), make_args(2, NUM_PAGES), backend_options={"pack_bytes": pack})
    try:
        jobs = [pair.job(7, i, [1 + 3 * i, 2 + 3 * i, 40 - i], [10 + 2 * i, 11 + 2 * i, 47 - i]) for i in range(8)]
        jobs.append(TransferJob(7, 8, pair.d_key, ()))
        for job in jobs:
            pair.prefill.submit(job)
        done = pair.events.wait(len(jobs))
        assert [j for j, _ in done] == jobs and all(e is None for _, e in done), done
        for job in jobs:
            for run in job.runs:
                for k in range(run.num_pages):
                    for s, d in zip((*pair.src.k_buffers, *pair.src.v_buffers),
                                    (*pair.dst.k_buffers, *pair.dst.v_buffers), strict=True):
                        assert torch.equal(_pages(d, run.dst_page + k), _pages(s, run.src_page + k))
        assert not pair.decode_events.done  # decode reports nothing; it only receives
    finally:
        pair.close()


@pytest.mark.parametrize("pack", ["0", "4194304"])
@pytest.mark.parametrize("backend", TWO_SIDED)
def test_head_slice_moves_only_those_heads(backend: str, pack: str) -> None:
    src = make_args(1, NUM_PAGES, heads=4, total_heads=4)  # prefill tp=1 holds heads 0..3
    dst = make_args(2, NUM_PAGES, heads=2, total_heads=4)  # decode tp rank 1 of 2 holds heads 2..3
    before = [b.clone() for b in (*dst.k_buffers, *dst.v_buffers)]
    pair = Pair(backend, src, dst, backend_options={"pack_bytes": pack})
    try:
        job = pair.job(3, 0, [5, 6, 7, 20], [30, 31, 32, 9], HeadSlice(src_head=2, dst_head=0, num_heads=2))
        pair.prefill.submit(job)
        assert pair.events.wait(1) == [(job, None)]
        for s, d, old in zip((*src.k_buffers, *src.v_buffers), (*dst.k_buffers, *dst.v_buffers), before,
                             strict=True):
            for sp, dp in ((5, 30), (6, 31), (7, 32), (20, 9)):
                assert torch.equal(_pages(d, dp), _pages(s, sp)[:, 2:4])
            untouched = [p for p in range(dst.num_pages) if p not in (30, 31, 32, 9)]
            assert all(torch.equal(_pages(d, p), _pages(old, p)) for p in untouched)
    finally:
        pair.close()


@pytest.mark.parametrize("backend", TWO_SIDED)
def test_destination_refuses_pages_outside_its_pool_and_writes_nothing(backend: str) -> None:
    dst = make_args(2, NUM_PAGES)
    before = [b.clone() for b in (*dst.k_buffers, *dst.v_buffers)]
    pair = Pair(backend, make_args(1, NUM_PAGES), dst)
    try:
        bad = TransferJob(1, 0, pair.d_key, (PageRun(3, NUM_PAGES, 2),))  # runs past the last page
        zero = TransferJob(2, 0, pair.d_key, (PageRun(3, 0, 1),))  # page 0 is padding, never a destination
        pair.prefill.submit(bad)
        pair.prefill.submit(zero)
        done = pair.events.wait(2)
        assert "refused" in (done[0][1] or "") and "outside pages" in (done[0][1] or ""), done
        assert done[1][1] and "decode/dp0/tp0" in done[1][1], done  # the connection is gone; names the peer
        assert all(torch.equal(b, o) for b, o in zip((*dst.k_buffers, *dst.v_buffers), before, strict=True))
    finally:
        pair.close()


def test_cancel_room_fails_queued_jobs_and_keeps_order(backend: str) -> None:
    pair = Pair(backend, make_args(1, NUM_PAGES), make_args(2, NUM_PAGES))
    try:
        jobs = [pair.job(room, i, [1 + i], [1 + i]) for i in range(40) for room in (11 if i % 2 else 12,)]
        for job in jobs:
            pair.prefill.submit(job)
        pair.prefill.cancel_room(11)
        done = pair.events.wait(len(jobs))
        assert [j for j, _ in done] == jobs
        assert all(err is None for job, err in done if job.room == 12), done
        assert any(err == "cancelled" for job, err in done if job.room == 11)
        assert "kv-" not in threading.current_thread().name and pair.events.threads  # reported off-thread
    finally:
        pair.close()


def test_remove_peer_and_close_fail_outstanding_jobs_once(backend: str) -> None:
    pair = Pair(backend, make_args(1, 200, layers=4), make_args(2, 200, layers=4))
    try:
        jobs = [pair.job(5, i, list(range(1, 200)), list(range(1, 200))) for i in range(6)]
        for job in jobs:
            pair.prefill.submit(job)
        pair.prefill.remove_peer(pair.d_key)
        done = pair.events.wait(len(jobs))
        assert [j for j, _ in done] == jobs
        assert any(err is not None for _, err in done)
        pair.prefill.submit(pair.job(6, 0, [1], [1]))  # after removal: an error, never a hang
        assert pair.events.wait(len(jobs) + 1)[-1][1]
    finally:
        pair.close()
        pair.close()  # idempotent


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKENDS)
def test_restarted_prefill_on_same_address_moves_pages_again(name: str) -> None:
    """A prefill killed and restarted on its address (new epoch) gets a fresh data connection / group."""
    first, second = plan_rooms(2, faults.NUM_PAGES, faults.NUM_PAGES, pages_per_room=4, seed=9)
    fixed = {"bootstrap_port": pick_free_port()}
    control = {"control_port": pick_free_port()}
    old = Child(RoleSpec("prefill", name, [first], num_pages=faults.NUM_PAGES, config_overrides=control, **fixed))
    mgr = faults._decode(name)
    try:
        assert wait_final(start_receivers(mgr, [first], old.bootstrap_addr), 10)[first.room][0] == KVPoll.Success
        old.kill()
        wait_restart_noticeable(mgr, old.instance_id)
        new = Child(RoleSpec("prefill", name, [second], num_pages=faults.NUM_PAGES, config_overrides=control,
                             **fixed))
        try:
            assert new.epoch > old.epoch
            result = wait_final(start_receivers(mgr, [second], new.bootstrap_addr), 15)
            assert result[second.room][0] == KVPoll.Success, result
            src = make_args(PREFILL_SEED, faults.NUM_PAGES)
            for s_buf, d_buf in zip((*src.k_buffers, *src.v_buffers), (*mgr.args.k_buffers, *mgr.args.v_buffers),
                                    strict=True):
                for s, d in zip(second.src_pages, second.dst_pages, strict=True):
                    assert torch.equal(_pages(d_buf, d), _pages(s_buf, s))
        finally:
            new.kill()
    finally:
        old.kill()
        mgr.close()


def _thread_cpu_s(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="per-thread CPU time from /proc")
def test_ucx_loop_thread_sleeps_between_transfers(no_threads_left: None) -> None:
    """Between transfers the process's UCX loop thread waits on the worker's event fd: it must not spin (a spinning
    loop takes a core and the GIL from the rank's scheduler thread). Both ways it used to: ucxx's blocking progress
    stops arming the worker after its first event, and a pending receive is polled every loop iteration."""
    from kvtransfer.backends.ucx_runtime import UcxRuntime

    pair = Pair("ucx", make_args(1, NUM_PAGES), make_args(2, NUM_PAGES))
    try:
        for i in range(3):  # events on the worker: connection, hello, PUTs, flushes
            pair.prefill.submit(pair.job(7, i, [1 + i], [1 + i]))
        assert all(err is None for _, err in pair.events.wait(3))
        thread = UcxRuntime._thread
        assert thread is not None and thread.native_id is not None
        time.sleep(0.3)
        cpu0, t0 = _thread_cpu_s(thread.native_id), time.monotonic()
        time.sleep(1.5)
        busy = (_thread_cpu_s(thread.native_id) - cpu0) / (time.monotonic() - t0)
        assert busy < 0.15, f"the idle UCX loop thread used {busy:.0%} of a core"
        pair.prefill.submit(pair.job(8, 0, [9], [9]))  # and it still wakes for the next transfer
        assert pair.events.wait(4)[-1][1] is None
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["nccl"])
def test_a_peer_paired_again_moves_pages_over_a_new_connection(backend: str, no_threads_left: None) -> None:
    """Both sides drop each other and pair again with the same peer starts (a stall past the heartbeat deadline,
    then a new handshake): the new pairing must not meet the old one's state (nccl: a group rendezvous under the old
    store prefix read the old group's keys and hung until its timeout)."""
    src, dst = make_args(1, NUM_PAGES), make_args(2, NUM_PAGES)
    cls, cfg = backend_class(backend), kv_config(backend, bootstrap_timeout_s=8.0)
    events = Events()
    p_key, d_key = PeerKey("prefill/dp0/tp0", time.time_ns()), PeerKey("decode/dp0/tp0", time.time_ns())
    prefill, decode = cls(src, cfg, "prefill", events, p_key), cls(dst, cfg, "decode", Events(), d_key)
    try:
        for n, pairing in enumerate(("first-handshake", "second-handshake")):
            if n:
                prefill.remove_peer(d_key)
                decode.remove_peer(p_key)
            prefill.add_peer(PeerInfo(d_key, dst.layout({}), decode.endpoint(), pairing))
            decode.add_peer(PeerInfo(p_key, src.layout({}), prefill.endpoint(), pairing))
            job = TransferJob(30 + n, 0, d_key, tuple(coalesce_runs([3 + n], [5 + n])))
            prefill.submit(job)
            assert events.wait(n + 1, timeout_s=20)[-1] == (job, None)
            assert _pages(dst.k_buffers[0], 5 + n).equal(_pages(src.k_buffers[0], 3 + n))
    finally:
        prefill.close()
        decode.close()


def test_ucx_a_job_of_the_dropped_pairing_ending_late_leaves_the_new_pairing_usable(no_threads_left: None) -> None:
    """Prefill drops a decode peer and adds it again with the same key (it handshook again after losing this rank)
    while a job of the old pairing is still leaving the loop: that job's failure must not mark the new pairing broken
    (every later room to the peer failed at once, "connection broken earlier: ... peer removed")."""
    pair = Pair("ucx", make_args(1, NUM_PAGES), make_args(2, NUM_PAGES))
    backend = pair.prefill
    started, release = threading.Event(), threading.Event()
    real_move = backend._move_async  # type: ignore[attr-defined]

    async def held_move(job: TransferJob, target: object, segments: object, on_loop: threading.Event,
                        left: threading.Event) -> None:
        """A job that ends only when released, after its cancellation (its worker waits for ``left``)."""
        on_loop.set()
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            deadline = time.monotonic() + 10
            while not release.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            left.set()

    try:
        backend._move_async = held_move  # type: ignore[attr-defined]
        old = pair.job(40, 0, [1], [1])
        backend.submit(old)
        assert started.wait(10)
        d_info = PeerInfo(pair.d_key, pair.dst.layout({}), pair.decode.endpoint())
        backend.remove_peer(pair.d_key)
        backend.add_peer(d_info)
        backend._move_async = real_move  # type: ignore[attr-defined]
        release.set()
        assert pair.events.wait(1)[0][0] is old and pair.events.wait(1)[0][1]  # the old pairing's job failed
        backend.submit(pair.job(41, 0, [3], [5]))
        assert pair.events.wait(2)[-1][1] is None
        assert _pages(pair.dst.k_buffers[0], 5).equal(_pages(pair.src.k_buffers[0], 3))
    finally:
        release.set()
        pair.close()


@pytest.mark.parametrize("backend", ["tcp", "shm", "nccl", "ucx"])
def test_a_layer_group_takes_the_head_slice_of_its_own_heads(backend: str) -> None:
    """Prefill tp 1 -> decode tp rank 1 of 2: the target's heads 2..3 of 4 and a draft group's head 1 of 2 move
    (``backends.grouped``: the job's slice scaled to each group's heads); nothing else is written."""
    from kvtransfer.registry import make_backend

    src = make_args(1, NUM_PAGES, heads=4, draft=(1, 2, 24))
    dst = make_args(2, NUM_PAGES, heads=2, tp_size=2, tp_rank=1, draft=(1, 1, 24))
    before = [b.clone() for b in (*dst.k_buffers, *dst.v_buffers)]
    cfg, events = kv_config(backend), Events()
    p_key, d_key = PeerKey("prefill/dp0/tp0", time.time_ns()), PeerKey("decode/dp0/tp1", time.time_ns())
    prefill = make_backend(src, cfg, "prefill", events, p_key)
    decode = make_backend(dst, cfg, "decode", Events(), d_key)
    try:
        prefill.add_peer(PeerInfo(d_key, dst.layout({}), decode.endpoint(), "pairing"))
        decode.add_peer(PeerInfo(p_key, src.layout({}), prefill.endpoint(), "pairing"))
        job = TransferJob(3, 0, d_key, tuple(coalesce_runs([5, 6, 20], [30, 31, 9])), HeadSlice(2, 0, 2))
        prefill.submit(job)
        assert events.wait(1) == [(job, None)]
        for layer, (s, d, old) in enumerate(zip((*src.k_buffers, *src.v_buffers), (*dst.k_buffers, *dst.v_buffers),
                                                before, strict=True)):
            heads = slice(2, 4) if layer % (LAYERS + 1) < LAYERS else slice(1, 2)  # K0 K1 Kdraft V0 V1 Vdraft
            for sp, dp in ((5, 30), (6, 31), (20, 9)):
                assert torch.equal(_pages(d, dp), _pages(s, sp)[:, heads]), layer
            assert all(torch.equal(_pages(d, p), _pages(old, p)) for p in range(dst.num_pages) if p not in (30, 31, 9))
    finally:
        prefill.close()
        decode.close()
