"""Sanity checks of what a worker reports about itself (``GetServerInfo``, ``GetLoad``) before the router acts on it.

A worker's facts steer every request (the router rejects prompts over the fleet's smallest ``context_len``, sizes
page reservations by ``page_size``, fans requests over ``dp_size`` ranks), so one absurd or inconsistent report must
make that worker unroutable instead of misleading the router. Each check returns why the facts are unacceptable, or
"" when they are fine; the messages name no address, secret or path.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdcluster.v1 import worker_pb2

MIN_CONTEXT_LEN = 16
MAX_CONTEXT_LEN = 10_000_000
MAX_PAGE_SIZE = 1024
MAX_PARALLEL = 4096  # tp_size / dp_size
# ServerInfo facts that every worker of one model and role must report alike.
FLEET_INVARIANTS = ("context_len", "page_size", "model_fingerprint", "vocab_size",
                    "schedule_low_priority_values_first")  # the router holds requests in the decode nodes' order


def info_problem(info: worker_pb2.ServerInfo) -> str:
    if not MIN_CONTEXT_LEN <= info.context_len <= MAX_CONTEXT_LEN:
        return f"reports context_len={info.context_len} (expected {MIN_CONTEXT_LEN}..{MAX_CONTEXT_LEN})"
    if not 1 <= info.page_size <= MAX_PAGE_SIZE:
        return f"reports page_size={info.page_size} (expected 1..{MAX_PAGE_SIZE})"
    for name in ("tp_size", "dp_size"):
        value = getattr(info, name)
        if not 1 <= value <= MAX_PARALLEL:
            return f"reports {name}={value} (expected 1..{MAX_PARALLEL})"
    if info.vocab_size < 1:
        return f"reports vocab_size={info.vocab_size}"
    if info.max_total_tokens < 0:
        return f"reports max_total_tokens={info.max_total_tokens}"
    return ""


def fleet_problem(info: worker_pb2.ServerInfo, peers: Iterable[worker_pb2.ServerInfo]) -> str:
    """Disagreement with the already accepted workers of the same model and role (``peers``)."""
    for peer in peers:
        if peer.served_model_name != info.served_model_name:
            continue
        for name in FLEET_INVARIANTS:
            mine, theirs = getattr(info, name), getattr(peer, name)
            if mine != theirs:
                shown = "differs" if name == "model_fingerprint" else f"{mine} (the fleet's: {theirs})"
                return f"reports {name} {shown}, unlike the accepted workers of model {info.served_model_name!r}"
    return ""


def load_problem(load: worker_pb2.GetLoadResponse, info: worker_pb2.ServerInfo) -> str:
    if load.page_size and load.page_size != info.page_size:
        return f"load report says page_size={load.page_size}, its server info {info.page_size}"
    seen: set[int] = set()
    for r in load.ranks:
        if not 0 <= r.dp_rank < info.dp_size or r.dp_rank in seen:
            return f"load report names dp_rank {r.dp_rank} (dp_size {info.dp_size}, or twice)"
        seen.add(r.dp_rank)
        if r.total_kv_pages <= 0:
            return f"rank {r.dp_rank} reports total_kv_pages={r.total_kv_pages}"
        if not 0 <= r.free_kv_pages <= r.total_kv_pages:
            return f"rank {r.dp_rank} reports free_kv_pages={r.free_kv_pages} of {r.total_kv_pages}"
        if r.free_req_slots < 0 or (r.total_req_slots > 0 and r.free_req_slots > r.total_req_slots):
            return f"rank {r.dp_rank} reports free_req_slots={r.free_req_slots} of {r.total_req_slots}"
        if r.evictable_tokens < 0 or (r.HasField("admissible_tokens") and r.admissible_tokens < 0):
            return f"rank {r.dp_rank} reports negative evictable/admissible tokens"
        if min(r.running, r.waiting, r.bootstrap, r.inflight, r.prealloc, r.transfer) < 0:
            return f"rank {r.dp_rank} reports a negative queue length"
    return ""
