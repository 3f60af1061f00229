"""Shared fixtures. Every engine a test builds through ``engine_factory`` is checked at teardown: its KV pages and
request slots are back at their initial free counts (the prefix cache may hold evictable pages; evicting them must
return every page to the allocator)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs several torch processes at once on few cores (xdist workers, their nodes' ranks): OpenMP's default
# spin-wait would burn the cores the other processes are waiting for. Tests assert behaviour, never speed.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The only place a fixed cluster secret exists: the test session and the processes it starts inherit it.
TEST_CLUSTER_TOKEN = "pdcluster-test-secret-not-for-deployment"
os.environ.setdefault("PDCLUSTER_CLUSTER_TOKEN", TEST_CLUSTER_TOKEN)


# The longest test files (approximate wall seconds under ``make test``'s 3 workers on the 2-core CI machine),
# collected first: under its xdist workers (``--dist loadfile --no-loadscope-reorder``: whole files per worker,
# handed out in collection order; xdist's default reorder would hand out the files with the most tests first) they
# start at once instead of holding the run's tail while the other workers idle.
LONGEST_FILES = (
    "tests/deploy/test_deploy_ray.py",  # ~220 s (its Ray cluster starts in 40-140 s)
    "tests/nodes/test_tp_nodes.py",  # ~170 s
    "tests/nodes/test_nodes.py",  # ~120 s
    "tests/cluster/test_soak.py",  # ~80 s
    "tests/engine/test_triton_kernels.py",  # ~70 s
    "tests/deploy/test_gpu_check_dry_run.py",  # one test, ~20 CPU s (its steps forked from one process)
    "tests/cluster/test_stall_cluster.py",
    "tests/cluster/test_structured_output_cluster.py",
    "tests/cluster/test_tp_cluster.py",
    "tests/cluster/test_cluster_e2e.py",
    "tests/engine/test_tp_engine.py",
    "tests/kvtransfer/test_kvtransfer_faults.py",
)


# PDCLUSTER_TEST_CPU=<dir>: each test process writes the CPU seconds (its own and its reaped children's) spent in
# each test file, to see where the suite's CPU goes (``make test`` is CPU-bound on 2 cores).
_CPU_DIR = os.environ.get("PDCLUSTER_TEST_CPU")
_cpu_by_file: dict[str, float] = {}


def _cpu_now() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _CPU_DIR:
        yield
        return
    start = _cpu_now()
    yield
    key = item.path.relative_to(item.config.rootpath).as_posix()
    _cpu_by_file[key] = _cpu_by_file.get(key, 0.0) + _cpu_now() - start


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _CPU_DIR and _cpu_by_file:
        import json

        Path(_CPU_DIR).mkdir(parents=True, exist_ok=True)
        (Path(_CPU_DIR) / f"cpu-{os.getpid()}.json").write_text(json.dumps(_cpu_by_file))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return  # one process: collection order (under xdist only the workers collect; they see numprocesses None)
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    root = config.rootpath

    def key(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(root).as_posix(), len(LONGEST_FILES))

    items.sort(key=key)  # stable: within a file, and among the other files, collection order is kept


@pytest.fixture
def no_threads_left() -> Iterator[None]:
    """Every thread a test started has ended within 5 s of its end (transfer workers, stripes, readers)."""
    before = set(threading.enumerate())
    yield
    end = time.monotonic() + 5
    while time.monotonic() < end and set(threading.enumerate()) - before:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before, f"threads left: {set(threading.enumerate()) - before}"


@pytest.fixture
def cluster_token() -> str:
    """The cluster secret of the test session's nodes and router."""
    return os.environ["PDCLUSTER_CLUSTER_TOKEN"]


def wait_idle(engine: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.scheduler.is_idle():
            return
        time.sleep(0.01)
    raise AssertionError("engine did not become idle")


def assert_pools_released(engine: Any) -> None:
    """Pools at their initial free counts once the prefix cache is emptied."""
    wait_idle(engine)
    _assert_released(engine.scheduler, stepped=True)


def assert_scheduler_pools_released(*schedulers: Any) -> None:
    """Each scheduler's pools at their initial free counts once its prefix cache is emptied (the caller's thread
    steps them: their hierarchical cache's copies settle in their steps)."""
    for s in schedulers:
        _assert_released(s, stepped=False)


def _assert_released(s: Any, stepped: bool) -> None:
    _wait_hicache_settled(s.tree_cache, None if stepped else lambda: s.step([]))
    free_slots = s.req_to_token_pool.available_size()
    assert free_slots == s.req_to_token_pool.size, (
        f"request slots leaked: {s.req_to_token_pool.size - free_slots}"
    )
    assert s.tree_cache.protected_size() == 0, "prefix cache still has locked (in-use) nodes"
    total = s.allocator.size
    cached = s.tree_cache.evictable_size()
    assert s.allocator.available_size() + cached == total, (
        f"KV slots leaked: free {s.allocator.available_size()} + cached {cached} != total {total}"
    )
    s.tree_cache.evict(total)
    assert s.allocator.available_size() == total
    _assert_host_released(s.tree_cache)


def _wait_hicache_settled(cache: Any, step: Callable[[], Any] | None, timeout: float = 10.0) -> None:
    """A hierarchical cache's loads, reads, write-throughs (their nodes locked) and loads given up on (whose pages
    it may still reserve) have ended: the scheduler's idle steps settle them (``step``: run one, else its thread
    does)."""
    from common.engine.mem.hicache.decode_offload import HiHeldPrefixCache
    from common.engine.mem.hicache.hiradix_cache import HiRadixCache

    if not isinstance(cache, HiRadixCache | HiHeldPrefixCache):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (cache.waits.settling or (
            cache.offloads if isinstance(cache, HiHeldPrefixCache) else (
                cache.ongoing_loads or cache.writing or (cache.storage is not None and cache.storage.ops)))):
        time.sleep(0.01)
        if step is not None:
            step()


def _assert_host_released(cache: Any) -> None:
    """A hierarchical cache's host pool (settled: ``_wait_hicache_settled``): every page it holds belongs to a
    host-only tree node (a decode node's: to no one), and evicting the host tier frees them all."""
    from common.engine.mem.hicache.decode_offload import HiHeldPrefixCache
    from common.engine.mem.hicache.hiradix_cache import HiRadixCache

    if not isinstance(cache, HiRadixCache | HiHeldPrefixCache):
        return
    if isinstance(cache, HiRadixCache):
        held = sum(len(n.host_pages) for n in cache._nodes() if n.host_pages is not None)
        assert cache.host_pool.used_pages == held, f"host pages leaked: {cache.host_pool.used_pages} used, {held} held"
        cache.evict_host(cache.host_pool.num_pages)
    assert cache.host_pool.used_pages == 0, f"host pages leaked: {cache.host_pool.used_pages}"


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Any]]:
    from common.node.engine import Engine

    engines: list[Any] = []

    def make(model_path: Path | str, **overrides: Any) -> Any:
        overrides.setdefault("max_total_tokens", 4096)
        overrides.setdefault("max_running_requests", 64)
        engine = Engine(model_path=str(model_path), **overrides)
        engines.append(engine)
        return engine

    yield make
    try:
        for engine in engines:
            assert_pools_released(engine)
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.fixture(scope="module")
def model_path() -> Path:
    """The tiny generated llama (built once per test session)."""
    from tests.model_fixtures import make_tiny_model

    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def colocated() -> Iterator[Any]:
    """A colocated tp 1 node on the tiny llama (``model_path``): the reference whose tokens the P/D, TP and cluster
    tests compare against. One per session (per xdist worker): the tests only send it greedy requests, and a node
    start is seconds of both cores; idle, it costs little."""
    from tests.model_fixtures import make_tiny_model
    from tests.node_helpers import start_node

    node = start_node("null", make_tiny_model("llama"))
    yield node
    node.stop()
