"""The hierarchical cache (``common/engine/mem/hicache``) on a colocated engine: a device pool of two prompts' pages,
six prompts, so every prompt is evicted before it comes back. Outputs are the plain engine's (greedy), the cached
counts say which tier served the prefix, and the device and host pools come back whole after each test
(``engine_factory``)."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import prometheus_client
import pytest
import torch

from common.config import ServerArgs
from common.engine.mem.hicache.storage.base import decode_record
from common.errors import ConfigError
from common.ports import pick_free_port

PAGE = 16
FULL = 96  # each prompt's full pages (100 tokens: 6 pages and a partial one)
rng = random.Random(52)
PROMPTS = [[rng.randrange(3, 250) for _ in range(100)] for _ in range(6)]
SP = {"max_new_tokens": 6, "temperature": 0}
BASE = {"max_total_tokens": 256, "max_running_requests": 8, "page_size": PAGE}  # 16 pages: two prompts' worth


@pytest.fixture(scope="module")
def expected(model_path: Path) -> list[list[int]]:
    from common.node.engine import Engine

    engine = Engine(model_path=str(model_path), **BASE)
    try:
        return [engine.generate(input_ids=p, sampling_params=SP).output_ids for p in PROMPTS]
    finally:
        engine.shutdown()


def run(engine: Any, prompts: list[list[int]]) -> list[Any]:
    return [engine.generate(input_ids=p, sampling_params=SP) for p in prompts]


@pytest.mark.parametrize(("policy", "overlap", "layout", "io"), [
    ("write_through", False, "layer_first", "kernel"), ("write_back", True, "page_first", "direct")])
def test_evicted_prefixes_come_back_from_the_host_with_the_same_outputs(engine_factory, model_path, expected, policy,
                                                                        overlap, layout, io) -> None:
    engine = engine_factory(model_path, **BASE, enable_hierarchical_cache=True, hicache_ratio=4.0,
                            hicache_write_policy=policy, enable_overlap_schedule=overlap,
                            disable_overlap_schedule=not overlap, hicache_mem_layout=layout, hicache_io_backend=io)
    first, second = run(engine, PROMPTS), run(engine, PROMPTS)
    assert [o.output_ids for o in first] == expected
    assert [o.output_ids for o in second] == expected
    assert [o.cached_tokens for o in first] == [0] * 6
    assert [o.cached_tokens for o in second] == [FULL] * 6  # evicted from the device each time, kept on the host
    assert [o.timing.cached_tokens_host for o in second] == [FULL] * 6
    report = engine.scheduler.tree_cache.hicache_report()
    assert report.load_bytes > 0 and report.write_bytes >= report.load_bytes
    assert report.hit_tokens == {"device": 0, "host": 6 * FULL, "storage": 0}
    if policy == "write_through":  # what /metrics shows of it (a dp_rank label no other test reports)
        from common.node.metrics import observe_load

        observe_load([msgspec.structs.replace(engine.get_load(), dp_rank=5200)])
        sample = prometheus_client.REGISTRY.get_sample_value
        assert sample("pdcluster_node_hicache_hit_tokens_total", {"tier": "host", "dp_rank": "5200"}) == 6 * FULL
        assert sample("pdcluster_node_hicache_load_bytes_total", {"dp_rank": "5200"}) == report.load_bytes
        assert sample("pdcluster_node_hicache_host_tokens", {"state": "total", "dp_rank": "5200"}) == 4 * 256
        assert sample("pdcluster_node_hicache_bandwidth_bytes_per_second", {"direction": "load", "dp_rank": "5200"})


def test_an_eagle_heads_kv_comes_back_from_the_host_with_its_prefix(engine_factory, model_path, expected) -> None:
    """EAGLE keeps its head's KV as one more layer under the target's slots: a prefix back from the host has the
    head's KV it had before its eviction (left behind, its slots would hold the KV of the prompt that used the pages
    since, the head would draft from that, and acceptance would drop with the outputs unchanged)."""
    from tests.engine.test_eagle_head import head_dir

    engine = engine_factory(model_path, **BASE, enable_hierarchical_cache=True, hicache_ratio=4.0,
                            disable_overlap_schedule=True, speculative_algorithm="EAGLE",
                            speculative_draft_model_path=str(head_dir("EAGLE")), speculative_num_steps=2)
    runner, cache = engine.scheduler.runner, engine.scheduler.tree_cache

    def head_kv() -> list[Any]:
        slots = cache.match_prefix(PROMPTS[0][:FULL]).device_indices
        assert len(slots) == FULL
        return [buf[slots].clone() for layer in runner.draft_kv.layers for buf in layer]

    outs = run(engine, PROMPTS[:1])
    before = head_kv()
    outs += run(engine, PROMPTS[1:3])  # two prompts' pages: prompt 0's leave the device, their pages reused
    again = run(engine, PROMPTS[:1])[0]
    assert [o.output_ids for o in [*outs, again]] == [*expected[:3], expected[0]]
    assert again.timing.cached_tokens_host == FULL
    assert all(a.equal(b) for a, b in zip(before, head_kv(), strict=True))


def check_layer_groups(layout: str, io: str, device: str) -> None:
    """Extra layers of another geometry (a STANDALONE draft's) travel in a group of their own: device -> host, a
    page's storage payload -> another host page, host -> other device pages, every byte of every layer kept
    (tests/gpu runs it on CUDA: pinned host pages, copy streams, the Triton gather/scatter)."""
    import torch

    from common.engine.mem.hicache.copy_engine import CopyEngine
    from common.engine.mem.hicache.host_pool import HostKVPool, device_page_bytes, slot_space_groups
    from common.engine.mem.kv_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(8, 4, torch.bfloat16, 2, 8, 2, device)
    draft = [(torch.randn(36, 1, 6).to(torch.bfloat16).to(device), torch.randn(36, 1, 6).to(torch.bfloat16).to(device))]
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape))
    groups = slot_space_groups(pool, draft)
    assert [len(g) for g in groups] == [4, 2]
    host = HostKVPool(groups, 4, 4, layout, pin=device != "cpu")
    assert host.bytes_per_page == device_page_bytes(groups, 4) == 4 * (4 * 2 * 8 + 2 * 6) * 2
    copier = CopyEngine(groups, host, io)
    try:
        staged: list[Any] = []
        assert copier.write(torch.tensor([2, 5]), torch.tensor([0, 1]), None, staged.append).wait()
        host.set_page_bytes(3, memoryview(bytearray(host.staged_page_bytes(staged[0], 1))))  # page 5 via "storage"
        assert copier.load(torch.tensor([0, 3]), torch.tensor([7, 8]), None).wait()
    finally:
        copier.close()
    for bufs in groups:
        for buf in bufs:
            pages = buf.view(-1, 4, *buf.shape[1:])
            assert pages[7].equal(pages[2]) and pages[8].equal(pages[5])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_pages_hold_every_layer_group_of_the_slot_space(layout) -> None:
    from common.engine.mem.hicache import storage_fingerprint
    from common.engine.spec.drafter import DraftKV

    check_layer_groups(layout, "kernel", "cpu")
    draft = ((torch.zeros(4, 1, 6), torch.zeros(4, 1, 6)),)
    model = type("M", (), {"fingerprint": lambda self: {"architecture": "llama"}})()
    args, tp = ServerArgs(page_size=4), type("TP", (), {"tp_size": 1, "tp_rank": 0})()
    with_draft = DraftKV(draft, (0, 0), {"draft_model": "STANDALONE:x"})
    assert storage_fingerprint(args, model, tp, with_draft) != storage_fingerprint(args, model, tp)  # type: ignore


def test_a_full_host_pool_evicts_its_least_recently_used_prefixes(engine_factory, model_path, expected) -> None:
    # 20 host pages: three prompts' worth. Write-back: the host receives what the device evicts, in LRU order.
    engine = engine_factory(model_path, **BASE, enable_hierarchical_cache=True, hicache_ratio=1.25,
                            hicache_write_policy="write_back")
    assert [o.output_ids for o in run(engine, PROMPTS)] == expected
    cache = engine.scheduler.tree_cache
    assert (cache.host_pool.num_pages, cache.host_pool.used_pages) == (20, 3 * FULL // PAGE)  # a 4th does not fit
    back = run(engine, [PROMPTS[3], PROMPTS[0]])  # the most recent evicted prompt, then the oldest
    assert [o.output_ids for o in back] == [expected[3], expected[0]]
    assert [o.cached_tokens for o in back] == [FULL, 0]
    assert cache.hicache_report().host_evicted_tokens >= 2 * FULL


def test_an_eviction_leaves_a_write_through_in_flight_for_a_later_step(engine_factory, model_path, expected,
                                                                       monkeypatch) -> None:
    """Two prompts' host writes held by the test, a third prompt that needs their device pages: their nodes stay
    locked while written, so no step waits for a write (the scheduler goes on answering) and the third prompt
    waits in the queue; once the writes end it evicts them to the host, and the first prompt comes back from there."""
    from common.engine.mem.hicache.copy_engine import CopyEngine

    gate, held, copy = threading.Event(), [], CopyEngine._copy_pages

    def gated(self: CopyEngine, job: Any) -> Any:
        if job.kind == "write":
            held.append(job)
            gate.wait(10)  # bounded: a step that waits for the write is held this long
        return copy(self, job)

    monkeypatch.setattr(CopyEngine, "_copy_pages", gated)
    engine = engine_factory(model_path, **BASE, enable_hierarchical_cache=True, hicache_ratio=4.0)
    third: list[Any] = []
    waiter = threading.Thread(target=lambda: third.extend(run(engine, PROMPTS[2:3])))
    try:
        assert [o.output_ids for o in run(engine, PROMPTS[:2])] == expected[:2]  # 12 pages in the tree, 4 free
        waiter.start()
        deadline = time.monotonic() + 30
        while engine.get_load().waiting == 0:
            assert time.monotonic() < deadline, "the third prompt was not queued"
        load = engine.get_load(timeout=5)  # a step after the one that found no page it could evict now
        assert load.waiting == 1 and not held[0].done.is_set()  # answered while the first write is still held
    finally:
        gate.set()
        waiter.join(30)
    assert [o.output_ids for o in third] == [expected[2]]
    again = run(engine, PROMPTS[:1])[0]
    assert again.output_ids == expected[0] and again.timing.cached_tokens_host == FULL  # written, then evicted


def test_a_failed_load_is_recomputed_with_the_same_outputs(engine_factory, model_path, expected, monkeypatch) -> None:
    from common.engine.mem.hicache.copy_engine import CopyEngine

    copy = CopyEngine._copy_pages

    def broken(self: CopyEngine, job: Any) -> Any:
        if job.kind == "load":
            raise OSError("injected: the host -> device copy failed")
        return copy(self, job)

    monkeypatch.setattr(CopyEngine, "_copy_pages", broken)
    engine = engine_factory(model_path, **BASE, enable_hierarchical_cache=True, hicache_ratio=4.0)
    run(engine, PROMPTS)
    second = run(engine, PROMPTS)
    assert [o.output_ids for o in second] == expected
    assert [(o.cached_tokens, o.timing.cached_tokens_host) for o in second] == [(0, 0)] * 6


def test_a_hung_load_and_a_hung_read_are_given_up_at_the_deadline(engine_factory, model_path, expected, monkeypatch,
                                                                  tmp_path) -> None:
    """--hicache-load-timeout: a request whose host load (then one whose wait_complete prefetch) hangs computes its
    prompt once the deadline passes, while the copy and the read still hang. The load is cancelled before it wrote
    a device page, so its pages are free again at once, and when the copy wakes up it writes none of them (they may
    be another prompt's by then); every pool comes back once both end (``engine_factory``)."""
    from common.engine.mem.hicache.copy_engine import CopyCancelled, CopyEngine
    from common.engine.mem.hicache.storage.file import FileStorage

    armed, release, hung = threading.Event(), threading.Event(), []
    copy, get = CopyEngine._copy_pages, FileStorage.get

    def hang(what: str) -> None:
        if armed.is_set() and not release.is_set():
            hung.append(what)
            release.wait(20)  # bounded: without the deadline the request waits this long, then finds a hit

    def hanging_copy(self: CopyEngine, job: Any) -> Any:
        if job.kind == "load":
            hang("load")
        return copy(self, job)

    def hanging_get(self: FileStorage, key: str) -> Any:
        hang("read")
        return get(self, key)

    monkeypatch.setattr(CopyEngine, "_copy_pages", hanging_copy)
    monkeypatch.setattr(FileStorage, "get", hanging_get)
    # 20 host pages: after the six prompts, prompt 3 is on the host only and prompt 0 in the store only.
    engine = engine_factory(model_path, **BASE, enable_hierarchical_cache=True, hicache_ratio=1.25,
                            hicache_load_timeout=1.0, hicache_storage_backend="file",
                            hicache_storage_prefetch_policy="wait_complete", hicache_storage_backend_extra_config=(
                                json.dumps({"file_path": str(tmp_path), "prefetch_threshold": 16})))
    try:
        assert [o.output_ids for o in run(engine, PROMPTS)] == expected
        cache = engine.scheduler.tree_cache
        tier = cache.storage
        deadline = time.monotonic() + 30
        while not all(tier.backend.exists(k.hex()) for k in tier.chain(tier.seed, PROMPTS[0][:FULL])):
            assert time.monotonic() < deadline, "prompt 0 was not written to the store"
            time.sleep(0.05)
        armed.set()
        outs = run(engine, [PROMPTS[3], PROMPTS[0]])
        assert [o.output_ids for o in outs] == [expected[3], expected[0]]
        assert [(o.cached_tokens, o.timing.cached_tokens_host, o.timing.cached_tokens_storage) for o in outs] == [
            (0, 0, 0)] * 2
        assert hung == ["load", "read"]  # answered while both still hang
        [abandoned] = cache.waits.abandoned
        job, alloc = abandoned.job, engine.scheduler.allocator
        deadline = time.monotonic() + 30
        while cache.writing:  # the two prompts' write-throughs (not held): then their nodes are evictable
            assert time.monotonic() < deadline, "a write-through did not end"
            time.sleep(0.01)
        assert not job.done.is_set() and abandoned.release is None  # cancelled, its device pages given back
        assert alloc.available_size() + cache.evictable_size() == alloc.size
        assert [op.expired for op in tier.ops.values()] == [True]
        assert engine.get_load().hicache.timeouts == 2  # /metrics: pdcluster_node_hicache_timeouts_total
        # its pages are free or another prompt's: a mark in them stays when the hung copy wakes up and ends
        buffers = [b.view(-1, PAGE, *b.shape[1:]) for g in cache.copier.groups for b in g]
        for b in buffers:
            b[job.device_pages] = 7.0
        release.set()
        assert job.done.wait(20)
        assert all(b[job.device_pages].eq(7.0).all() for b in buffers), "the late copy wrote its device pages"
        assert isinstance(job.error, CopyCancelled)
    finally:
        release.set()


def test_the_storage_tier_serves_another_node_and_recomputes_a_bad_page(engine_factory, model_path, expected,
                                                                        tmp_path) -> None:
    flags = {**BASE, "enable_hierarchical_cache": True, "hicache_ratio": 4.0, "hicache_storage_backend": "file",
             "hicache_storage_prefetch_policy": "wait_complete",
             "hicache_storage_backend_extra_config": json.dumps({"file_path": str(tmp_path), "prefetch_threshold": 16})}
    first = engine_factory(model_path, **flags)
    assert [o.output_ids for o in run(first, PROMPTS[:3])] == expected[:3]
    deadline = time.monotonic() + 30
    while len(list(tmp_path.rglob("*.kv"))) < 3 * FULL // PAGE:  # written behind
        assert time.monotonic() < deadline, "pages were not written to the store"
        time.sleep(0.05)
    other = engine_factory(model_path, **flags)
    tier = other.scheduler.tree_cache.storage
    paths = [[tier.backend.path(k.hex()) for k in tier.chain(tier.seed, p[:FULL])] for p in PROMPTS[:3]]
    with open(paths[1][2], "r+b") as f:  # prompt 1's third page: garbage in its payload
        f.seek(512)
        f.write(b"\x7f" * 4096)
    paths[2][0].unlink()  # prompt 2's first page: gone
    outs = run(other, PROMPTS[:3])
    assert [o.output_ids for o in outs] == expected[:3]
    assert [o.cached_tokens for o in outs] == [FULL, 2 * PAGE, 0]
    assert [o.timing.cached_tokens_storage for o in outs] == [FULL, 2 * PAGE, 0]
    deadline = time.monotonic() + 30
    while decode_record(tier.chain(tier.seed, PROMPTS[1][:FULL])[2], tier.backend.get(paths[1][2].stem),
                        tier.host_pool.bytes_per_page) is None:  # the bad page was removed and written again
        assert time.monotonic() < deadline, "the corrupted page was not replaced"
        time.sleep(0.05)


@pytest.fixture
def mooncake_master() -> Iterator[str]:
    """A Mooncake store's master (the binary the installed wheel ships), on a free local port. Ask for it before
    ``engine_factory``: the engines' stores close while it still runs (a close without a master waits it out)."""
    mooncake = pytest.importorskip("mooncake")
    binary = Path(mooncake.__file__).parent / "mooncake_master"
    if not binary.is_file():
        pytest.skip("the installed mooncake wheel ships no mooncake_master")
    port = pick_free_port()
    proc = subprocess.Popen([str(binary), f"--rpc_port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "mooncake_master did not start"
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_a_mooncake_store_serves_another_node(mooncake_master, engine_factory, model_path, expected) -> None:
    extra = {"master_server_address": mooncake_master, "prefetch_threshold": 16, "global_segment_size": 32 << 20,
             "local_buffer_size": 8 << 20}
    flags = {**BASE, "enable_hierarchical_cache": True, "hicache_ratio": 4.0, "hicache_storage_backend": "mooncake",
             "hicache_storage_prefetch_policy": "timeout", "hicache_storage_backend_extra_config": json.dumps(extra)}
    first = engine_factory(model_path, **flags)
    assert [o.output_ids for o in run(first, PROMPTS[:2])] == expected[:2]
    tier = first.scheduler.tree_cache.storage
    deadline = time.monotonic() + 30
    while tier.write_bytes < 2 * FULL // PAGE * tier.host_pool.bytes_per_page:
        assert time.monotonic() < deadline, "pages were not written to the store"
        time.sleep(0.05)
    outs = run(engine_factory(model_path, **flags), PROMPTS[:2])
    assert [o.output_ids for o in outs] == expected[:2]
    assert [o.timing.cached_tokens_storage for o in outs] == [FULL, FULL]


@pytest.mark.parametrize(("flags", "message"), [
    ({"hicache_ratio": 3.0}, "--hicache-ratio needs --enable-hierarchical-cache"),
    ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "drop --disable-radix-cache"),
    ({"enable_hierarchical_cache": True, "hicache_size": 4, "hicache_ratio": 3.0}, "give one"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": '{"prefetch_timeout_base": 2}'}, "prefetch_timeout_base is read by"),
    ({"enable_hierarchical_cache": True, "hicache_storage_prefetch_policy": "timeout"},
     "--hicache-storage-prefetch-policy needs --hicache-storage-backend"),
    ({"enable_hierarchical_cache": True, "disaggregation_mode": "decode", "hicache_storage_backend": "file"},
     "--hicache-storage-backend is for prefill and colocated nodes"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"}, "master_server_address"),
    ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file",
      "hicache_storage_backend_extra_config": '{"path": "/x"}'}, "unknown key 'path'"),
])
def test_hicache_flags_that_would_go_unused_are_refused(flags, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerArgs(**flags)
