"""The one-sided backends (``nixl`` over UCX, ``ucx`` PUTs through ucxx's UCP handles, ``mooncake`` over its TCP
transport) through the ``KVBackend`` interface, both sides in this process.

The cross-process matrix (64 interleaved rooms, kills, aborts, restarts, refusals) covers them in
test_kvtransfer_transfer.py and test_kvtransfer_faults.py; here: what only a one-sided backend does.
"""

from __future__ import annotations

import importlib
import sys
import time

import pytest
import torch

from common.config import ServerArgs
from common.errors import ConfigError
from kvtransfer.backends.base import PeerInfo, PeerKey, TransferJob
from kvtransfer.pages import HeadSlice, PageRun
from kvtransfer.registry import backend_class
from kvtransfer.testing import PAGE_SIZE, backend_param, kv_config, make_args
from tests.kvtransfer.test_kvtransfer_backends_extra import Events, Pair

NUM_PAGES = 48
pytestmark = pytest.mark.usefixtures("no_threads_left")
ONE_SIDED = ["nixl", "ucx", backend_param("mooncake")]


def _pages(buf: torch.Tensor, page: int) -> torch.Tensor:
    return buf[page * PAGE_SIZE:(page + 1) * PAGE_SIZE]


def _all(args) -> tuple[torch.Tensor, ...]:
    return (*args.k_buffers, *args.v_buffers)


def test_decode_endpoint_publishes_agent_and_buffers_prefill_none() -> None:
    pair = Pair("nixl", make_args(1, NUM_PAGES), make_args(2, NUM_PAGES))
    try:
        ep = pair.decode.endpoint()
        assert ep["memory"] == "cpu" and ep["mem_type"] == "DRAM" and ep["metadata"]
        assert [int(b) for b in ep["bases"].split(",")] == [b.data_ptr() for pair_ in zip(
            pair.dst.k_buffers, pair.dst.v_buffers, strict=True) for b in pair_]
        assert "metadata" not in pair.prefill.endpoint()  # a WRITE initiator exposes no memory
    finally:
        pair.close()


def test_idle_agents_do_not_spin() -> None:
    """An idle node's NIXL agents leave the cores alone: NIXL's Python API gives every agent's progress thread a
    zero poll timeout (a core each, as long as the node lives); the backend gives it ``progress_delay_us``. The
    pair's two agents, idle for 1 s: a spinning thread alone takes ~1 s of CPU (~0.5 on a loaded 2-core box)."""
    pair = Pair("nixl", make_args(1, NUM_PAGES), make_args(2, NUM_PAGES))
    try:
        time.sleep(0.2)  # start-up done
        cpu = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - cpu < 0.15
    finally:
        pair.close()


def test_the_progress_delay_is_a_checked_option() -> None:
    assert ServerArgs(kv_transfer_backend="nixl", kv_transfer_option=("progress_delay_us=0",))
    with pytest.raises(ConfigError, match="progress_delay_us must be an integer between 0 and 1000000"):
        ServerArgs(kv_transfer_backend="nixl", kv_transfer_option=("progress_delay_us=-5",))


@pytest.mark.parametrize("backend", ONE_SIDED)
def test_jobs_land_byte_exact_in_order_and_empty_jobs_complete(backend: str) -> None:
    dst = make_args(2, NUM_PAGES)
    before = [b.clone() for b in _all(dst)]
    pair = Pair(backend, make_args(1, NUM_PAGES), dst)
    try:
        jobs = [pair.job(7, i, [1 + 3 * i, 2 + 3 * i, 40 - i], [10 + 2 * i, 11 + 2 * i, 47 - i]) for i in range(8)]
        jobs.insert(3, TransferJob(7, 99, pair.d_key, ()))
        for job in jobs:
            pair.prefill.submit(job)
        done = pair.events.wait(len(jobs))
        assert [j for j, _ in done] == jobs and all(e is None for _, e in done), done
        written = {}
        for job in jobs:
            for run in job.runs:
                written.update({run.dst_page + k: run.src_page + k for k in range(run.num_pages)})
        for s, d, old in zip(_all(pair.src), _all(dst), before, strict=True):
            for page in range(dst.num_pages):
                want = _pages(s, written[page]) if page in written else _pages(old, page)
                assert torch.equal(_pages(d, page), want), page
        assert not pair.decode_events.done
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ONE_SIDED)
def test_head_slice_writes_only_those_heads(backend: str) -> None:
    src = make_args(1, NUM_PAGES, heads=4, total_heads=4)  # prefill tp=1 holds heads 0..3
    dst = make_args(2, NUM_PAGES, heads=2, total_heads=4)  # decode tp rank 1 of 2 holds heads 2..3
    before = [b.clone() for b in _all(dst)]
    pair = Pair(backend, src, dst)
    try:
        job = pair.job(3, 0, [5, 6, 7, 20], [30, 31, 32, 9], HeadSlice(src_head=2, dst_head=0, num_heads=2))
        pair.prefill.submit(job)
        assert pair.events.wait(1) == [(job, None)]
        for s, d, old in zip(_all(src), _all(dst), before, strict=True):
            for sp, dp in ((5, 30), (6, 31), (7, 32), (20, 9)):
                assert torch.equal(_pages(d, dp), _pages(s, sp)[:, 2:4])
            untouched = [p for p in range(dst.num_pages) if p not in (30, 31, 32, 9)]
            assert all(torch.equal(_pages(d, p), _pages(old, p)) for p in untouched)
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ONE_SIDED)
def test_job_of_more_segments_than_one_engine_batch_lands_whole(backend: str) -> None:
    """A head slice is one segment per token slot per buffer: 199 pages x 4 slots x 4 buffers = 3184 segments,
    more than one Mooncake batch takes (2048)."""
    src = make_args(1, 200, heads=4, total_heads=4)
    dst = make_args(2, 200, heads=2, total_heads=4)
    pair = Pair(backend, src, dst)
    try:
        src_pages, dst_pages = list(range(1, 200)), list(range(199, 0, -1))
        job = pair.job(4, 0, src_pages, dst_pages, HeadSlice(src_head=1, dst_head=0, num_heads=2))
        pair.prefill.submit(job)
        assert pair.events.wait(1) == [(job, None)]
        for s, d in zip(_all(src), _all(dst), strict=True):
            assert all(torch.equal(_pages(d, dp), _pages(s, sp)[:, 1:3]) for sp, dp in zip(src_pages, dst_pages, strict=True))
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ONE_SIDED)
def test_pages_outside_the_peer_pool_and_bad_heads_are_refused_and_write_nothing(backend: str) -> None:
    dst = make_args(2, NUM_PAGES)
    before = [b.clone() for b in _all(dst)]
    pair = Pair(backend, make_args(1, NUM_PAGES), dst)
    try:
        jobs = [TransferJob(1, 0, pair.d_key, (PageRun(3, NUM_PAGES, 2),)),  # runs past the last page
                TransferJob(2, 0, pair.d_key, (PageRun(3, 0, 1),)),  # page 0 is padding, never a destination
                TransferJob(3, 0, pair.d_key, (PageRun(3, 4, 1),), HeadSlice(0, 1, 2))]  # past the peer's heads
        for job in jobs:
            pair.prefill.submit(job)
        done = pair.events.wait(3)
        assert "outside the peer's" in (done[0][1] or "") and "outside the peer's" in (done[1][1] or ""), done
        assert "head slice" in (done[2][1] or ""), done
        assert all("decode/dp0/tp0" in (err or "") for _, err in done), done
        assert all(torch.equal(b, o) for b, o in zip(_all(dst), before, strict=True))
    finally:
        pair.close()


def test_unloadable_peer_fails_its_jobs_naming_the_cause() -> None:
    cls = backend_class("nixl")
    events = Events()
    src = make_args(1, NUM_PAGES)
    prefill = cls(src, kv_config("nixl"), "prefill", events, PeerKey("prefill/dp0/tp0", 1))
    bad = PeerKey("decode/dp0/tp0", 2)
    try:
        prefill.add_peer(PeerInfo(bad, make_args(2, NUM_PAGES).layout({}), {"agent": "x", "memory": "cpu"}))
        job = TransferJob(1, 0, bad, (PageRun(1, 1, 1),))
        prefill.submit(job)
        [(got, err)] = events.wait(1)
        assert got is job and err and "not loaded" in err and "bases" in err, err
    finally:
        prefill.close()


@pytest.mark.parametrize("backend", ONE_SIDED)
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


def test_missing_package_is_a_clear_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "kvtransfer.backends.nixl", raising=False)
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # as if `nixl` were not installed
    with pytest.raises(ImportError, match=r"--kv-transfer-backend nixl needs the `nixl` package"):
        importlib.import_module("kvtransfer.backends.nixl")


def test_mooncake_decode_publishes_session_and_buffers_prefill_none() -> None:
    pytest.importorskip("mooncake.engine")
    pair = Pair("mooncake", make_args(1, NUM_PAGES), make_args(2, NUM_PAGES))
    try:
        ep = pair.decode.endpoint()
        host, _, port = ep["session"].rpartition(":")
        assert ep["memory"] == "cpu" and host == "127.0.0.1" and int(port) > 0
        assert [int(b) for b in ep["bases"].split(",")] == [b.data_ptr() for b in _all_layer_major(pair.dst)]
        assert "session" not in pair.prefill.endpoint()  # a WRITE initiator exposes no memory
    finally:
        pair.close()


def test_mooncake_unusable_peer_fails_its_jobs_naming_the_cause() -> None:
    pytest.importorskip("mooncake.engine")
    events = Events()
    prefill = backend_class("mooncake")(make_args(1, NUM_PAGES), kv_config("mooncake"), "prefill", events,
                                        PeerKey("prefill/dp0/tp0", 1))
    bad = PeerKey("decode/dp0/tp0", 2)
    try:
        prefill.add_peer(PeerInfo(bad, make_args(2, NUM_PAGES).layout({}), {"memory": "cpu"}))
        job = TransferJob(1, 0, bad, (PageRun(1, 1, 1),))
        prefill.submit(job)
        [(got, err)] = events.wait(1)
        assert got is job and err and "segment is unknown" in err and "session" in err, err
    finally:
        prefill.close()


def test_mooncake_missing_package_is_a_clear_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "kvtransfer.backends.mooncake", raising=False)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # as if the wheel (or libibverbs1) were missing
    with pytest.raises(ImportError, match=r"--kv-transfer-backend mooncake needs the Mooncake Transfer Engine.*"
                                          r"mooncake-transfer-engine-non-cuda.*libibverbs1"):
        importlib.import_module("kvtransfer.backends.mooncake")


def _all_layer_major(args) -> list[torch.Tensor]:
    return [b for pair_ in zip(args.k_buffers, args.v_buffers, strict=True) for b in pair_]
