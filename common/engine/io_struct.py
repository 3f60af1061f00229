"""Messages between a node's front process (or the in-process ``Engine``) and its scheduler ranks.

All are msgspec structs, tagged so one decoder reads the union: they go over ZMQ IPC as msgpack, or through an
in-process queue as objects. Token-in/token-out: tokenization and detokenization happen outside the scheduler.
"""

from __future__ import annotations

import msgspec

from common.engine.sampling.params import SamplingParams
from common.errors import ErrorCode


class GenerateReqInput(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = True
    # Disaggregation (None in colocated mode).
    bootstrap_room: int | None = None
    bootstrap_addr: str | None = None  # decode side: the prefill node's host:bootstrap_port
    prefill_dp_rank: int | None = None
    # Request migration: the last ``prior_output_len`` input ids are outputs of an interrupted earlier attempt.
    prior_output_len: int = 0
    # Priority scheduling (--enable-priority-scheduling; common.engine.schedule_policy): None is the least urgent.
    priority: int | None = None


class AbortReq(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    reason: str = "aborted by client"
    # Why, as the request's KV room fails: CANCELLED (the client went, or an explicit Abort) or DEADLINE_EXCEEDED.
    code: ErrorCode = ErrorCode.CANCELLED


class LoadReq(msgspec.Struct, tag=True, kw_only=True):
    pass


class ShutdownReq(msgspec.Struct, tag=True, kw_only=True):
    pass


class Timing(msgspec.Struct, kw_only=True):
    """Per-request time breakdown in seconds (0 where a phase does not apply)."""

    queue: float = 0.0  # waiting for a prefill batch
    bootstrap: float = 0.0  # disaggregation: waiting for the peer (handshake, destination pages)
    prefill: float = 0.0  # first prefill chunk start -> first token
    transfer: float = 0.0  # KV transfer (decode: prealloc -> transfer done)
    decode_queue: float = 0.0
    ttft: float = 0.0  # arrival at the scheduler -> first token
    e2e: float = 0.0
    transfer_bytes: int = 0
    cached_tokens_host: int = 0  # of the cached prompt tokens: loaded back from the host tier
    cached_tokens_storage: int = 0  # of the cached prompt tokens: prefetched from the storage tier


class TokenOut(msgspec.Struct, tag=True, kw_only=True):
    """New tokens of one request since its last ``TokenOut``; ``finish_reason`` set on the last one."""

    rid: str
    token_ids: list[int]
    logprobs: list[float] = []
    top_logprobs: list[list[tuple[int, float]]] = []
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    error: str | None = None  # for "abort": what happened
    error_code: ErrorCode | None = None  # for "abort": the gRPC status the client sees
    error_origin: str | None = None  # KV_PEER_FAULT: the failure was the KV transfer peer's, not this node's
    timing: Timing | None = None
    # Speculative decoding, on the final message: verify steps that checked drafts of this request, the draft
    # tokens proposed to it and how many of them it emitted (its accept length: 1 + accepted / verify steps).
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class HiCacheLoad(msgspec.Struct, kw_only=True):
    """A rank's hierarchical cache (``--enable-hierarchical-cache``): host pool occupancy and its traffic since start."""

    host_tokens_used: int = 0
    host_tokens_total: int = 0
    load_bytes: int = 0  # host -> device
    load_seconds: float = 0.0
    write_bytes: int = 0  # device -> host (write-through, write-back, a decode node's offload)
    write_seconds: float = 0.0
    host_evicted_tokens: int = 0
    storage_read_bytes: int = 0
    storage_write_bytes: int = 0
    storage_dropped_pages: int = 0  # not written behind: the store's write queue was full
    timeouts: int = 0  # loads and prefetches given up at --hicache-load-timeout (their requests computed the prefix)
    storage: str = ""  # the storage tier's identity ("file:<directory>", "mooncake:<master>"); "" without one
    hit_tokens: dict[str, int] = {}  # cached prompt tokens per tier (device, host, storage) at prefill start


class QueueLoad(msgspec.Struct, kw_only=True):
    dp_rank: int
    running: int
    waiting: int
    bootstrap: int = 0
    inflight: int = 0
    prealloc: int = 0
    transfer: int = 0
    free_kv_pages: int
    total_kv_pages: int
    free_req_slots: int
    total_req_slots: int
    token_usage: float
    evictable_tokens: int = 0
    admissible_tokens: int | None = None  # decode nodes: see RankLoad.admissible_tokens
    preempt_priority: int | None = None  # decode nodes with priority scheduling: see RankLoad.preempt_priority
    # Requests per queue name and priority class (the priority value, "none": sent without one).
    queue_by_priority: dict[str, dict[str, int]] = {}
    preemptions: int = 0  # running requests retracted by priority preemption since start
    hicache: HiCacheLoad | None = None  # with --enable-hierarchical-cache


class LoadOut(msgspec.Struct, tag=True, kw_only=True):
    load: QueueLoad


class RankReady(msgspec.Struct, tag=True, kw_only=True):
    """A scheduler rank finished loading and serves; or failed to start (``error`` set)."""

    dp_rank: int
    tp_rank: int = 0
    max_total_tokens: int = 0
    error: str | None = None


class RankHeartbeat(msgspec.Struct, tag=True, kw_only=True):
    """A scheduler rank is stepping: sent after a completed step or idle poll, at most every heartbeat interval.

    A rank stuck inside one step sends none; the front's liveness fails after ``--watchdog-timeout`` without one.
    """

    dp_rank: int
    steps: int  # completed loop iterations (steps and idle polls) since start
    tp_rank: int = 0


class PrefillDone(msgspec.Struct, tag=True, kw_only=True):
    """Prefill node: the request's KV reached the decode node (or failed: ``error``/``error_code`` set)."""

    rid: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_code: ErrorCode | None = None
    error_origin: str | None = None  # KV_PEER_FAULT: the decode peer's fault
    timing: Timing | None = None


SchedulerInput = GenerateReqInput | AbortReq | LoadReq | ShutdownReq
SchedulerOutput = TokenOut | LoadOut | RankReady | PrefillDone | RankHeartbeat
