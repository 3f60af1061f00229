"""Waiting-queue policies (fcfs, lpm, dfs-weight, lof, random), in-batch prefix caching and priority classes: each
policy's order on a constructed queue and radix tree, and on a real scheduler what each mechanism buys (cached tokens,
prefill tokens computed). Preemption by priority: test_priority_preemption.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import ServerArgs
from common.engine.mem.allocator import TokenToKVPoolAllocator
from common.engine.mem.radix_cache import RadixCache
from common.engine.mem.req_to_token_pool import ReqToTokenPool
from common.engine.req import Req
from common.engine.sampling.params import SamplingParams
from common.engine.schedule_policy import LPM_FALLBACK_QUEUE_LEN, SchedulePolicy
from common.errors import ConfigError, InvalidRequestError
from tests.engine.scheduler_driver import PS, Driver
from tests.model_fixtures import make_tiny_model


def make_policy(policy: str = "fcfs", tree: bool = True, **kw: Any) -> SchedulePolicy:
    args = ServerArgs(schedule_policy=policy, page_size=PS, **kw)
    alloc = TokenToKVPoolAllocator(256, PS)
    cache = RadixCache(ReqToTokenPool(8, 512), alloc, PS, disable=not tree)
    return SchedulePolicy(args, cache, alloc, cache.req_to_token_pool)


def cache_tokens(policy: SchedulePolicy, ids: list[int]) -> None:
    slots = policy.allocator.alloc(len(ids))
    assert slots is not None
    policy.tree_cache.insert(ids, slots)


def req(rid: str, ids: list[int], max_new: int = 8, priority: int = 0) -> Req:
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new), priority=priority)


def rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


# -- orders on a constructed queue and tree --------------------------------------------------------------------------
def test_fcfs_keeps_arrival_order_and_priority_goes_first() -> None:
    queue = [req("a", [1] * 9), req("b", [2] * 9, priority=5), req("c", [3] * 9, priority=5)]
    queue.reverse()  # the queue's current order is not arrival order (e.g. retracted requests re-entered ahead)
    make_policy("fcfs").calc_priority(queue)
    assert rids(queue) == ["c", "b", "a"]  # fcfs without priorities keeps the queue as it is (SGLang's)
    make_policy("fcfs", enable_priority_scheduling=True).calc_priority(queue)
    assert rids(queue) == ["b", "c", "a"]  # larger first, then arrival
    make_policy("fcfs", enable_priority_scheduling=True, schedule_low_priority_values_first=True).calc_priority(queue)
    assert rids(queue) == ["a", "b", "c"]


def test_lpm_orders_by_cached_prefix_without_touching_the_tree() -> None:
    policy = make_policy("lpm")
    shared = list(range(100, 140))
    cache_tokens(policy, shared)
    nodes_before = len(policy.tree_cache._nodes())
    queue = [req("none", [7] * 41), req("p8", shared[:8] + [9] * 33), req("p40", [*shared, 5]),
             req("p20", shared[:20] + [8] * 21)]
    policy.calc_priority(queue)
    assert rids(queue) == ["p40", "p20", "p8", "none"]
    assert len(policy.tree_cache._nodes()) == nodes_before, "lpm's match split a node (it must be read-only)"
    assert policy.tree_cache.protected_size() == 0, "lpm's match locked a node"


def test_lpm_falls_back_to_fcfs_on_a_long_queue() -> None:
    policy = make_policy("lpm")
    shared = list(range(100, 140))
    cache_tokens(policy, shared)
    queue = [req(f"r{i}", [i + 1000] * 41) for i in range(LPM_FALLBACK_QUEUE_LEN)] + [req("hit", [*shared, 1])]
    policy.calc_priority(queue)
    assert queue[-1].rid == "hit"  # 129 waiting: fcfs
    queue.pop(0)
    policy.calc_priority(queue)
    assert queue[0].rid == "hit"  # 128 waiting: lpm


def test_dfs_weight_schedules_heavier_subtrees_first() -> None:
    policy = make_policy("dfs-weight")
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    cache_tokens(policy, a + b)
    cache_tokens(policy, a + c)
    cache_tokens(policy, c + c)
    # Under a: b-branch 1 request, c-branch 2; a itself 1 (diverges right after a). Under root/c: 2. Uncached: 1.
    queue = [req("ab", a + b + [50, 51]), req("ac1", a + c + [60, 61]), req("cc1", c + c + [1, 1]),
             req("a", [*a, 70, 71, 72, 73, 74]), req("ac2", a + c + [62, 63]), req("cc2", c + c + [2, 2]),
             req("x", [99] * 9)]
    policy.calc_priority(queue)
    # a's subtree weighs 4 (> c's 2): its heavier branch (ac, 2) first, then ab, then a's own; then cc; root's last.
    assert rids(queue) == ["ac1", "ac2", "ab", "a", "cc1", "cc2", "x"]


def test_lof_and_random() -> None:
    queue = [req("short", [1] * 5, max_new=4), req("long", [1] * 5, max_new=64), req("mid", [1] * 5, max_new=16)]
    make_policy("lof").calc_priority(queue)
    assert rids(queue) == ["long", "mid", "short"]
    orders = []
    for _ in range(2):
        policy = make_policy("random", seed=3)
        queue = [req(str(i), [1] * 5) for i in range(20)]
        policy.calc_priority(queue)
        orders.append(rids(queue))
    assert orders[0] == orders[1], "random must be seeded: every TP rank draws the same order"
    assert orders[0] != [str(i) for i in range(20)]


def test_cache_aware_policy_without_radix_cache_is_fcfs() -> None:
    assert make_policy("lpm", tree=False).policy == "fcfs"
    with pytest.raises(ConfigError, match="--schedule-policy"):
        ServerArgs(schedule_policy="longest")


def test_in_batch_followers_of_an_uncached_prefix_sit_out() -> None:
    policy = make_policy("lpm")
    shared = list(range(200, 264))
    queue = [req("lead", [*shared, 1, 2]), req("other", list(range(300, 340))), req("f1", [*shared, 3]),
             req("f2", shared[:40] + [4] * 10), req("short", shared[:20])]
    policy.calc_priority(queue)
    assert {r.rid for r in queue if r.sits_out} == {"f1", "f2"}
    assert rids(queue)[-2:] == ["f1", "f2"]


@pytest.mark.parametrize("policy", ["fcfs", "lof", "random"])
def test_repeated_prompts_sit_out_behind_the_first_under_every_policy(policy: str) -> None:
    prompt = list(range(100, 120))
    queue = [req("a", prompt), req("other", list(range(300, 320))), req("b", prompt), req("c", prompt),
             req("short", [7] * PS), req("short2", [7] * PS)]
    started = req("d", prompt)
    started.output_ids = [5]  # a retracted request with output resumes its own sequence: never held
    queue.append(started)
    pol = make_policy(policy)
    pol.calc_priority(queue)
    held = {r.rid for r in queue if r.sits_out}
    assert len(held) == 2 and held < {"a", "b", "c"}, held  # one of the three computes it (the first in order)
    assert next(r for r in queue if r.origin_input_ids == prompt).sits_out is False
    assert not make_policy(policy, tree=False).has_tree  # no radix cache: nothing to share, nobody waits
    queue = [req("a", prompt), req("b", prompt)]
    make_policy(policy, tree=False).calc_priority(queue)
    assert not any(r.sits_out for r in queue)


def test_priority_on_a_node_without_priority_scheduling_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="--enable-priority-scheduling"):
        make_policy().resolve_priority(3)
    on = make_policy(enable_priority_scheduling=True)
    assert on.resolve_priority(None) < on.resolve_priority(-1000)  # none is the least urgent


# -- a real scheduler ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama() -> Path:
    return make_tiny_model("llama")


def shared_prefix_workload(systems: int, users: int, seed: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 1000) for _ in range(48)] for _ in range(systems)]
    work = [(f"s{s}u{u}", prompts[s] + [rng.randrange(10, 1000) for _ in range(6)])
            for s in range(systems) for u in range(users)]
    rng.shuffle(work)
    return work


def run_workload(llama: Path, policy: str, work: list[tuple[str, list[int]]]) -> Driver:
    # A KV cache of 256 tokens holds about 4 of the 8 system prompts: the order decides what is still cached.
    d = Driver(llama, schedule_policy=policy, max_prefill_tokens=128, chunked_prefill_size=-1, max_total_tokens=256)
    d.submit(work, max_new_tokens=2)
    d.run()
    return d


def test_lpm_caches_more_than_fcfs_on_a_shuffled_shared_prefix_workload(llama) -> None:
    work = shared_prefix_workload(systems=8, users=4, seed=1)
    fcfs, lpm = run_workload(llama, "fcfs", work), run_workload(llama, "lpm", work)
    try:
        fcfs_cached, lpm_cached = sum(fcfs.cached.values()), sum(lpm.cached.values())
        assert lpm_cached > 1.5 * fcfs_cached, (lpm_cached, fcfs_cached)
        assert lpm.forward_tokens < fcfs.forward_tokens
        assert lpm.outs == fcfs.outs  # the order changes what is cached, never the tokens
    finally:
        fcfs.close()
        lpm.close()


def test_in_batch_prefix_caching_computes_a_shared_uncached_prefix_once(llama) -> None:
    rng = random.Random(4)
    shared = [rng.randrange(10, 1000) for _ in range(64)]
    work = [(f"u{i}", shared + [rng.randrange(10, 1000) for _ in range(4)]) for i in range(4)]
    d = Driver(llama, schedule_policy="lpm", chunked_prefill_size=-1)
    try:
        d.submit(work, max_new_tokens=2)
        d.run()
        # Once: 64 shared + 4 own for the leader, then the followers' own tails (from the last whole page).
        assert d.forward_tokens == 68 + 3 * 4, d.forward_tokens
        assert sorted(d.cached.values()) == [0, 64, 64, 64]
    finally:
        d.close()


def test_n_choices_of_one_prompt_prefill_it_once_under_fcfs(llama) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(10, 1000) for _ in range(64)]
    d = Driver(llama, chunked_prefill_size=-1)  # fcfs, the default
    try:
        d.submit([(f"c{i}", prompt) for i in range(3)], max_new_tokens=4)
        d.run()
        # The first computes the prompt; the others wait for it to be cached and compute its last page only.
        assert d.forward_tokens == 64 + 2 * PS, d.forward_tokens
        assert sorted(d.cached.values()) == [0, 64 - PS, 64 - PS]
        assert d.outs["c0"] == d.outs["c1"] == d.outs["c2"]  # greedy: the shared KV changes nothing
    finally:
        d.close()


def test_peek_prefix_matches_match_prefix() -> None:
    policy = make_policy("lpm")
    ids = list(range(1, 30))
    cache_tokens(policy, ids)
    for key in (ids, ids[:10] + [0] * 5, [5] * 9, ids[:3]):
        n, _ = policy.tree_cache.peek_prefix(key)
        assert n == len(policy.tree_cache.match_prefix(key).device_indices)
    assert torch.equal(policy.tree_cache.match_prefix(ids).device_indices[:4],
                       policy.tree_cache.match_prefix(ids[:4]).device_indices)


def test_queue_lengths_per_priority_class_and_preemptions_reach_prometheus() -> None:
    import prometheus_client

    from common.engine.io_struct import QueueLoad
    from common.node.metrics import observe_load

    def sample(name: str, **labels: str) -> float | None:
        return prometheus_client.REGISTRY.get_sample_value(name, labels)

    def load(by_priority: dict[str, dict[str, int]], preemptions: int) -> QueueLoad:
        return QueueLoad(dp_rank=7, running=0, waiting=3, free_kv_pages=1, total_kv_pages=1, free_req_slots=1,
                         total_req_slots=1, token_usage=0.0, queue_by_priority=by_priority, preemptions=preemptions)

    policy = make_policy(enable_priority_scheduling=True)
    queue = [req("a", [1] * 5, priority=5), req("b", [1] * 5, priority=5),
             req("c", [1] * 5, priority=policy.resolve_priority(None))]
    by_priority = policy.queue_by_priority(queue)
    assert by_priority == {"5": 2, "none": 1}
    observe_load([load({"waiting": by_priority}, 2)])
    queue_gauge, preempted = "pdcluster_node_queue_requests_by_priority", "pdcluster_node_priority_preemptions_total"
    assert sample(queue_gauge, queue="waiting", priority="5", dp_rank="7") == 2
    assert sample(queue_gauge, queue="waiting", priority="none", dp_rank="7") == 1
    assert sample(preempted, dp_rank="7") == 2
    observe_load([load({"waiting": {"none": 1}}, 3)])
    assert sample(queue_gauge, queue="waiting", priority="5", dp_rank="7") == 0  # an emptied class goes to 0
    assert sample(preempted, dp_rank="7") == 3
