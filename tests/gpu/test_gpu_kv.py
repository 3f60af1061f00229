"""KV transfer of CUDA buffers: backends byte-exact across processes, and PD on one GPU token-identical to colocated.

Skipped without CUDA. ``shm`` = CUDA IPC (same GPU; across GPUs with 2+), ``tcp`` = staged through pinned host
buffers, ``nccl`` = two GPUs (and its clear refusal of two ranks on one GPU).
"""

from __future__ import annotations

import importlib.util
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.manager import KVManager
from kvtransfer.pages import HeadSlice
from kvtransfer.poll import KVPoll
from kvtransfer.testing import (
    DECODE_SEED,
    PAGE_SIZE,
    Child,
    RoleSpec,
    kv_config,
    make_args,
    plan_rooms,
    start_receivers,
    transfer_interleaved_rooms,
    wait_final,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NUM_PAGES = 64 * 5 + 16
NIXL = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="the nixl wheel is not installed here")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
SMALL_SEGMENTS = {"backend_options": {"stage_bytes": str(3 * 4 * PAGE_SIZE * 2 * 8 * 2)}}  # 3 pages a segment
STRIPED_SEGMENTS = {"backend_options": {**SMALL_SEGMENTS["backend_options"], "streams": "3", "stripe_bytes": "1"}}


def _pages(buf: torch.Tensor, page: int) -> torch.Tensor:
    return buf[page * PAGE_SIZE:(page + 1) * PAGE_SIZE]


def _transfer(backend: str, prefill_device: str, decode_device: str, config: dict | None = None) -> None:
    """64 interleaved chunked rooms, prefill in a child process on ``prefill_device``, decode here."""
    transfer_interleaved_rooms(backend, config, seed=3, num_pages=NUM_PAGES, prefill_device=prefill_device,
                               decode_device=decode_device)


def test_shm_cuda_ipc_same_gpu_byte_exact() -> None:
    _transfer("shm", "cuda:0", "cuda:0")


@TWO_GPUS
def test_shm_cuda_ipc_across_gpus_byte_exact() -> None:
    _transfer("shm", "cuda:1", "cuda:0")


def test_tcp_staged_same_gpu_byte_exact() -> None:
    _transfer("tcp", "cuda:0", "cuda:0", SMALL_SEGMENTS)


def test_tcp_staged_striped_same_gpu_byte_exact() -> None:
    _transfer("tcp", "cuda:0", "cuda:0", STRIPED_SEGMENTS)  # every job of >= 2 pages on up to 3 streams' stagers


def test_tcp_staged_gpu_to_cpu_and_back_byte_exact() -> None:
    _transfer("tcp", "cuda:0", "cpu", SMALL_SEGMENTS)
    _transfer("tcp", "cpu", "cuda:0", SMALL_SEGMENTS)


@NIXL
def test_nixl_vram_same_gpu_byte_exact() -> None:
    _transfer("nixl", "cuda:0", "cuda:0")  # VRAM registered with UCX; UCX_TLS must allow cuda_ipc/cuda_copy


@NIXL
def test_nixl_vram_to_dram_byte_exact() -> None:
    _transfer("nixl", "cuda:0", "cpu")


@TWO_GPUS
def test_nccl_across_gpus_byte_exact() -> None:
    _transfer("nccl", "cuda:1", "cuda:0")


def test_nccl_on_one_gpu_fails_rooms_naming_shm_and_tcp() -> None:
    plans = plan_rooms(2, 32, 32, pages_per_room=3, seed=4)
    child = Child(RoleSpec("prefill", "nccl", plans, num_pages=32, args_overrides={"device": "cuda:0"},
                           linger_s=5))
    mgr = KVManager(make_args(DECODE_SEED, 32, device="cuda:0"), kv_config("nccl"), DecodeRooms)
    try:
        receivers = start_receivers(mgr, plans, child.bootstrap_addr)
        result = wait_final(receivers, 30)
        assert all(state == KVPoll.Failed for state, _ in result.values()), result
        prefill_result, _ = child.result()
        for state, failure in prefill_result.values():
            assert state == KVPoll.Failed and "cannot pair two ranks on one GPU" in failure, failure
            assert "shm" in failure and "tcp" in failure, failure
    finally:
        mgr.close()
        child.kill()


@pytest.mark.parametrize(("backend", "config"), [("shm", {}), ("tcp", SMALL_SEGMENTS),
                                                   pytest.param("nixl", {}, marks=NIXL)])
def test_head_slices_of_cuda_buffers(backend: str, config: dict) -> None:
    from tests.kvtransfer.test_kvtransfer_backends_extra import Pair

    src = make_args(1, 48, heads=4, total_heads=4, device="cuda:0")
    dst = make_args(2, 48, heads=2, total_heads=4, device="cuda:0")
    before = [b.cpu() for b in (*dst.k_buffers, *dst.v_buffers)]
    pair = Pair(backend, src, dst, **config)  # shm: a same-process peer (its pool is used directly)
    try:
        job = pair.job(3, 0, [5, 6, 7, 20], [30, 31, 32, 9], HeadSlice(src_head=2, dst_head=0, num_heads=2))
        pair.prefill.submit(job)
        assert pair.events.wait(1) == [(job, None)]
        for s, d, old in zip((*src.k_buffers, *src.v_buffers), (*dst.k_buffers, *dst.v_buffers), before,
                             strict=True):
            s, d = s.cpu(), d.cpu()
            for sp, dp in ((5, 30), (6, 31), (7, 32), (20, 9)):
                assert torch.equal(_pages(d, dp), _pages(s, sp)[:, 2:4])
            for p in set(range(dst.num_pages)) - {30, 31, 32, 9}:
                assert torch.equal(_pages(d, p), _pages(old, p))
    finally:
        pair.close()


# ---- PD nodes on one GPU -------------------------------------------------------------------------------------------
GPU_FLAGS = ["--device", "cuda", "--base-gpu-id", "0"]


@pytest.fixture(scope="module")
def model_path():
    from tests.model_fixtures import make_tiny_model

    return make_tiny_model("llama")


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_pd_on_one_gpu_tokens_match_colocated(model_path, backend: str) -> None:
    from tests.node_helpers import start_node
    from tests.nodes.test_nodes import PROMPT_LENGTHS, greedy_request, reference, run_pd

    extra = [*GPU_FLAGS, "--page-size", "16", "--chunked-prefill-size", "64"]
    colocated = start_node("null", model_path, extra=extra, wait=False)
    prefill = start_node("prefill", model_path, backend=backend, extra=extra, wait=False)
    decode = start_node("decode", model_path, backend=backend, extra=extra, wait=False)
    try:
        for node in (colocated, prefill, decode):
            node.wait_ready()
        rng = random.Random(7)
        reqs = [greedy_request(f"gpu-{backend}-{i}", [rng.randrange(10, 1000) for _ in range(n)])
                for i, n in enumerate(PROMPT_LENGTHS)]
        expected = [reference(colocated, r) for r in reqs]
        rooms = rng.sample(range(1, 2**63), len(reqs))
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda a: run_pd(prefill, decode, *a), zip(reqs, rooms, strict=True)))
        for req, want, (got, fin, _) in zip(reqs, expected, results, strict=True):
            assert got == want, f"prompt of {len(req.input_ids)} tokens"
            assert fin.timing.transfer_bytes > 0
        prefill.wait_pools_free()
        decode.wait_pools_free()
        colocated.wait_pools_free()
    finally:
        for node in (colocated, prefill, decode):
            node.stop()


@pytest.mark.parametrize("landing_signal", ["auto", "off"])
def test_shm_cuda_ipc_landing_signals_across_processes(monkeypatch, landing_signal: str) -> None:
    """The prefill child's event ring is opened here through its IPC handles (not this process's table) and every
    chunk's ChunkDone carries a signal; with ``landing_signal=off`` none does (today's path). Byte-exact either way."""
    from kvtransfer.backends import signals
    from kvtransfer.landing import LandingWatch

    seen: list[int] = []
    chunk = LandingWatch.chunk
    monkeypatch.setattr(LandingWatch, "chunk", lambda w, rec, src, msg, now: (seen.append(msg.signal),
                                                                               chunk(w, rec, src, msg, now)))

    def check(mgr: KVManager) -> None:
        readers = mgr.backend.impl._signal_readers.by_peer
        if landing_signal == "off":
            assert not readers and seen and all(s == 0 for s in seen), seen
            return
        (reader,) = readers.values()
        assert isinstance(reader, signals.CudaEventReader)
        assert all(reader.events is not ring.events for ring in signals._RINGS.values())  # opened from its handles
        assert seen and all(s > 0 for s in seen), seen

    transfer_interleaved_rooms("shm", {"backend_options": {"landing_signal": landing_signal}}, seed=3,
                               num_pages=NUM_PAGES, prefill_device="cuda:0", decode_device="cuda:0", check=check)


def test_shm_cuda_chunk_done_precedes_the_landing_and_success_follows_it(monkeypatch) -> None:
    """In one process (the same-process ring): the copy is held back on the prefill's stream by a spin kernel, so
    the ChunkDone reaches decode before the copy landed; decode's Success and prefill's come after it landed, and
    decode's pages are then byte-exact without a device synchronization of the copy stream."""
    from kvtransfer.backends import shm_cuda
    from kvtransfer.landing import LandingWatch
    from tests.kvtransfer.test_kvtransfer_signals import Pair

    make_copier = shm_cuda.page_copier

    def slow_copier(*args, **kwargs):
        copy = make_copier(*args, **kwargs)

        def slow(ids: torch.Tensor) -> None:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on the copy stream before the copy
            copy(ids)
        return slow

    monkeypatch.setattr(shm_cuda, "page_copier", slow_copier)
    arrivals: list[tuple[int, bool]] = []  # (signal, the copy stream idle when the ChunkDone arrived)
    chunk = LandingWatch.chunk

    def copy_stream_idle() -> bool:
        return all(pool.stream.query() for pool in pair.prefill.backend.impl._pools.values())

    def arrive(watch, rec, source, msg, now):
        arrivals.append((msg.signal, copy_stream_idle()))
        chunk(watch, rec, source, msg, now)

    monkeypatch.setattr(LandingWatch, "chunk", arrive)
    auto = {"landing_signal": "auto"}  # GPU pools only; off is the default
    pair = Pair(auto, auto, device="cuda:0")
    try:
        sender, receiver, _ = pair.run(chunks=2)  # checks decode's pages when it reaches Success
        assert sender.poll() == KVPoll.Success and receiver.poll() == KVPoll.Success
        assert copy_stream_idle()
        assert arrivals and all(signal > 0 for signal, _ in arrivals), arrivals
        assert not all(idle for _, idle in arrivals), arrivals  # announced while the copy was still in flight
    finally:
        pair.close()
