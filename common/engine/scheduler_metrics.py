"""``RankMetrics``: what a rank reports of itself — its load (``load``, the answer to a ``LoadReq``) and the seeds'
per-rank log lines, one formatter for ``Prefill batch.`` and one for ``Decode batch.``.

Field order is SGLang's. The disaggregation fields appear only on the role that owns the queue (SGLang omits them
on colocated nodes): ``#bootstrap-req``/``#inflight-req`` on prefill nodes, ``#prealloc-req``/``#transfer-req``
on decode nodes. A role scheduler supplies its counts through ``SchedulerRole.queue_counts``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from common.engine.io_struct import QueueLoad

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.distributed import TPGroup
    from common.engine.mem.allocator import TokenToKVPoolAllocator
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from common.engine.req import Req
    from common.engine.schedule_policy import PrefillAdder

# NOTE: the log lines are the scheduler's: they keep its logger's name, which operators and tests filter on.
logger = logging.getLogger("common.engine.scheduler")


@dataclass(frozen=True)
class DisaggQueueCounts:
    """Requests in a role's own queues at the time of a log line; ``None`` where the role has no such queue."""

    bootstrap: int | None = None
    inflight: int | None = None
    prealloc: int | None = None
    transfer: int | None = None


NO_DISAGG_QUEUES = DisaggQueueCounts()


@dataclass(frozen=True)
class PrefillStats:
    new_seq: int
    new_token: int
    cached_token: int
    token_usage: float
    running_req: int
    queue_req: int
    queues: DisaggQueueCounts = NO_DISAGG_QUEUES


@dataclass(frozen=True)
class DecodeStats:
    running_req: int
    token: int
    token_usage: float
    retracted_req: int
    gen_throughput: float
    queues: DisaggQueueCounts = NO_DISAGG_QUEUES
    accept_len: float | None = None  # speculative decoding: tokens emitted per request per verify step


def format_prefill_line(s: PrefillStats) -> str:
    line = (
        f"Prefill batch. #new-seq: {s.new_seq}, #new-token: {s.new_token}, #cached-token: {s.cached_token}, "
        f"token usage: {s.token_usage:.2f}, #running-req: {s.running_req}, #queue-req: {s.queue_req}"
    )
    q = s.queues
    if q.bootstrap is not None or q.inflight is not None:
        line += f", #bootstrap-req: {q.bootstrap or 0}, #inflight-req: {q.inflight or 0}"
    return line


def format_decode_line(s: DecodeStats) -> str:
    line = f"Decode batch. #running-req: {s.running_req}, #token: {s.token}, token usage: {s.token_usage:.2f}, "
    if s.accept_len is not None:
        line += f"accept len: {s.accept_len:.2f}, "
    q = s.queues
    if q.prealloc is not None or q.transfer is not None:
        line += f"#prealloc-req: {q.prealloc or 0}, #transfer-req: {q.transfer or 0}, "
    return line + f"#retracted-req: {s.retracted_req}, gen throughput (token/s): {s.gen_throughput:.2f}"


class DecodeLogInterval:
    """Counts decode steps, generated tokens and retractions between two ``Decode batch.`` lines.

    Invariant: every counter covers exactly the span since the last line (or since the rank was last idle);
    ``take`` resets them, so the throughput is the interval's tokens over the interval's wall time, and an idle
    rank's first line after new work is not diluted by the time it had nothing to do.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.decode_steps = 0
        self.tokens = 0
        self.retracted = 0
        self.verify_steps = 0  # speculative decoding: (request, verify step) pairs with drafts
        self.verify_tokens = 0  # tokens they emitted
        self.since = time.monotonic()

    def on_decode_step(self) -> bool:
        """Count one decode step; whether a line is due after it."""
        self.decode_steps += 1
        return self.decode_steps % self.interval == 0

    def restart(self) -> None:
        """The rank is idle: the next interval starts now (the step cadence is kept)."""
        self.since, self.tokens = time.monotonic(), 0

    def take(self) -> tuple[float, int, float | None]:
        """(gen throughput in token/s, retractions, accept length or None without verify steps) over the interval;
        starts the next interval."""
        now = time.monotonic()
        throughput = self.tokens / max(now - self.since, 1e-6)
        retracted = self.retracted
        accept_len = self.verify_tokens / self.verify_steps if self.verify_steps else None
        self.since, self.tokens, self.retracted, self.verify_steps, self.verify_tokens = now, 0, 0, 0, 0
        return throughput, retracted, accept_len


class RankMetrics:
    """Token usage, the load report and the two log lines of one rank, read from its pools and prefix cache; the
    queues' part is handed in by whoever holds them."""

    def __init__(self, args: ServerArgs, tp: TPGroup, dp_rank: int, allocator: TokenToKVPoolAllocator,
                 req_to_token_pool: ReqToTokenPool, tree_cache: Any, max_total_num_tokens: int,
                 queue_counts: Callable[[], DisaggQueueCounts]) -> None:
        self.args = args
        self.tp = tp
        self.dp_rank = dp_rank
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.tree_cache = tree_cache
        self.max_total_num_tokens = max_total_num_tokens
        self.queue_counts = queue_counts  # the role's queues (``SchedulerRole.queue_counts``)
        self.decode_log = DecodeLogInterval(args.decode_log_interval)

    def num_used_tokens(self) -> int:
        """KV slots held by requests (the prefix cache's evictable slots count as free)."""
        return self.max_total_num_tokens - self.allocator.available_size() - self.tree_cache.evictable_size()

    def token_usage(self) -> float:
        return self.num_used_tokens() / self.max_total_num_tokens

    def load(self, running: int, waiting: int, queue_by_priority: dict[str, dict[str, int]],
             preemptions: int) -> QueueLoad:
        """This replica's load. With TP (a collective: every rank answers the same LoadReq) the free counts are the
        MIN over the group, so a rank that leaked shows; ranks that disagree at all are logged as diverged."""
        free_kv, free_slots = self.allocator.available_size(), self.req_to_token_pool.available_size()
        evictable = self.tree_cache.evictable_size()
        if self.tp.tp_size > 1:
            mine = [free_kv, free_slots, evictable]
            both = self.tp.all_reduce_min(torch.tensor(mine + [-v for v in mine], dtype=torch.int64)).tolist()
            lo, hi = both[:3], [-v for v in both[3:]]
            if lo != hi:
                logger.error("TP ranks of DP %d diverged: free KV slots, free request slots, evictable tokens "
                             "range over %s .. %s", self.dp_rank, lo, hi)
            free_kv, free_slots, evictable = lo[0], lo[1], hi[2]
        page_size = self.args.page_size
        return QueueLoad(
            dp_rank=self.dp_rank,
            running=running,
            waiting=waiting,
            free_kv_pages=free_kv // page_size,
            total_kv_pages=self.max_total_num_tokens // page_size,
            free_req_slots=free_slots,
            total_req_slots=self.req_to_token_pool.size,
            token_usage=self.token_usage(),
            evictable_tokens=evictable,
            queue_by_priority=queue_by_priority,
            preemptions=preemptions,
            hicache=self.tree_cache.hicache_report() if self.args.enable_hierarchical_cache else None,
        )

    def log_prefill(self, adder: PrefillAdder, running_bs: int, queue_req: int) -> None:
        """One line per prefill batch, after admission: the queue no longer holds the batch's requests."""
        if not logger.isEnabledFor(logging.INFO):
            return
        logger.info(format_prefill_line(PrefillStats(
            new_seq=len(adder.can_run_list),
            new_token=adder.log_input_tokens,
            cached_token=adder.log_hit_tokens,
            token_usage=self.token_usage(),
            running_req=running_bs,
            queue_req=queue_req,
            queues=self.queue_counts(),
        )))

    def log_retract(self, retracted: int, running_bs: int, new_token_ratio: float) -> None:
        """A decode step did not fit: ``retracted`` requests went back to the waiting queue."""
        self.decode_log.retracted += retracted
        logger.info("KV cache is full: retracted %d requests, #running-req: %d, new_token_ratio: %.4f",
                    retracted, running_bs, new_token_ratio)

    def log_decode(self, running_reqs: list[Req], speculating: bool) -> None:
        """One line every ``--decode-log-interval`` decode steps, with the interval's gen throughput."""
        if not self.decode_log.on_decode_step():
            return
        throughput, retracted, accept_len = self.decode_log.take()
        if not logger.isEnabledFor(logging.INFO):
            return
        logger.info(format_decode_line(DecodeStats(
            running_req=sum(not r.finished() for r in running_reqs),
            token=self.num_used_tokens(),
            token_usage=self.token_usage(),
            retracted_req=retracted,
            gen_throughput=throughput,
            queues=self.queue_counts(),
            accept_len=(accept_len or 1.0) if speculating else None,
        )))
