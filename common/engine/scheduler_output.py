"""A batch's output: what its result does to each request (``process_batch_result``: append the token, then finish,
cache or stop the request) and the ``TokenOut`` messages a scheduler step produces, handed to the sink in one call
per step (``OutputCollector``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from common.engine.io_struct import Timing, TokenOut
from common.engine.req import Req
from common.engine.sampling.grammar import accept_grammar_token, finish_on_grammar
from common.engine.sampling.stop import check_finished
from common.engine.scheduler_metrics import MetricsSource, log_decode_stats
from common.errors import ErrorCode
from common.faults import inject

if TYPE_CHECKING:
    from common.engine.model_runner import BatchResult
    from common.engine.schedule_batch import ScheduleBatch
    from common.engine.scheduler_role import SchedulerRole


def req_timing(req: Req) -> Timing:
    t = req.times
    first = t.first_token or t.finished
    timing = Timing(
        ttft=max(0.0, first - t.arrival),
        e2e=max(0.0, t.finished - t.arrival) if t.finished else 0.0,
        cached_tokens_host=req.cached_tokens_host,
        cached_tokens_storage=req.cached_tokens_storage,
    )
    if t.transfer_done:  # decode node: the prompt's KV came from a prefill node
        timing.decode_queue = max(0.0, (t.bootstrapped or t.transfer_done) - t.queue_enter)
        timing.transfer = max(0.0, t.transfer_done - (t.bootstrapped or t.transfer_done))
        timing.transfer_bytes = req.kv_transfer_bytes
    else:
        timing.queue = max(0.0, (t.forward_start or first) - t.queue_enter) if t.queue_enter else 0.0
        timing.prefill = max(0.0, first - t.forward_start) if t.forward_start else 0.0
    return timing


class OutputCollector:
    """``TokenOut``s of one step, sent in one ``sink`` call. A streaming request's tokens go out every
    ``stream_interval`` tokens (its first at once), a non-streaming request's only with its end (SGLang's
    ``--stream-interval``): one message per token per request is most of a large batch's result processing."""

    def __init__(self, sink: Callable[[list[Any]], None], stream_interval: int = 1) -> None:
        self.sink = sink
        self.stream_interval = stream_interval
        self.pending: list[Any] = []

    def _delta(self, req: Req) -> TokenOut:
        start = req.sent_len
        req.sent_len = len(req.output_ids)
        out = TokenOut(
            rid=req.rid,
            token_ids=req.output_ids[start:],
            prompt_tokens=len(req.origin_input_ids),
            cached_tokens=req.cached_tokens,
            completion_tokens=len(req.output_ids),
        )
        if req.return_logprob:
            out.logprobs = req.output_logprobs[start:]
            out.top_logprobs = req.output_top_logprobs[start:]
        return out

    def stream_token(self, req: Req) -> None:
        if req.finished() or not req.stream:
            return
        if req.sent_len == 0 or len(req.output_ids) - req.sent_len >= self.stream_interval:
            self.pending.append(self._delta(req))

    def finish(self, req: Req) -> None:
        out = self._delta(req)
        reason = req.finished_reason
        assert reason is not None
        out.finish_reason = reason.reason.value
        out.matched_stop = reason.matched
        if reason.message:
            out.error = reason.message
            out.error_code = reason.code
            out.error_origin = reason.origin or None
        out.timing = req_timing(req)
        out.spec_verify_ct, out.spec_draft_tokens = req.spec_verify_ct, req.spec_draft_tokens
        out.spec_accepted_tokens = req.spec_accepted_tokens
        self.pending.append(out)

    def error(self, rid: str, message: str, code: ErrorCode) -> None:
        self.pending.append(TokenOut(rid=rid, token_ids=[], finish_reason="abort", error=message, error_code=code))

    def send_now(self, msgs: list[Any]) -> None:
        self.sink(msgs)

    def flush(self) -> None:
        if self.pending:
            msgs, self.pending = self.pending, []
            self.sink(msgs)


class ResultState(MetricsSource, Protocol):
    """What processing a batch's result reads and moves of the scheduler (``common.engine.scheduler.Scheduler``)."""

    tokenizer: Any
    out: OutputCollector

    @property
    def role(self) -> SchedulerRole: ...

    def fail_req(self, req: Req, exc: Exception) -> None: ...

    def finish_req(self, req: Req, release: bool = True) -> None: ...


def process_batch_result(sched: ResultState, batch: ScheduleBatch, result: BatchResult) -> None:
    """The one result path: append each row's token, then finish, cache or stop it; the role is asked when a
    chunk or a whole prompt is done."""
    is_prefill = batch.forward_mode.is_extend()
    decoding = {id(r) for r in batch.decoding_reqs}
    slots = batch.future_slots
    for i, req in enumerate(batch.reqs):
        if slots is not None and req.future_slot == slots[i]:
            req.future_slot = None  # no newer step of it was launched
        if req.finished() or req.is_retracted:  # retracted while in flight: it recomputes this token
            continue
        if req.is_chunked > 0:  # a middle chunk: its token is not a real sample
            req.is_chunked -= 1
            _check_chunked(sched, req)
            continue
        prefilled = is_prefill and id(req) not in decoding
        try:
            append_tokens(sched, batch, req, result, i)
            if prefilled:
                sched.role.on_prefill_done(req)
        except Exception as e:
            sched.fail_req(req, e)
            continue
        if req.finished():
            sched.finish_req(req)
        elif prefilled:
            sched.tree_cache.cache_unfinished_req(req)
    if not is_prefill:
        log_decode_stats(sched)
    sched.out.flush()


def append_tokens(sched: ResultState, batch: ScheduleBatch, req: Req, result: BatchResult, i: int) -> None:
    """Row i's token; in a verify step, request i's accepted run, token by token until one ends it (no token after a
    stop is emitted), then the rejected drafts' KV is given back (``common.engine.spec.info``)."""
    spec = batch.spec_info
    if spec is None:
        append_token(sched, req, result, i)
        return
    before = len(req.output_ids)
    try:
        for row in spec.accepted_rows(i, result.next_token_ids):
            append_token(sched, req, result, row)
            if req.finished():
                break
    finally:
        spec.commit(batch, req, i, len(req.output_ids) - before, sched.decode_log)


def append_token(sched: ResultState, req: Req, result: BatchResult, i: int) -> None:
    inject("token", req.rid)
    token = result.next_token_ids[i]
    if not accept_grammar_token(req, token):
        return
    req.output_ids.append(token)
    sched.decode_log.tokens += 1
    if not req.times.first_token:
        req.times.first_token = time.monotonic()
    if req.return_logprob and result.logprobs is not None:
        req.output_logprobs.append(result.logprobs[i])
        if result.top_logprobs is not None:
            req.output_top_logprobs.append(result.top_logprobs[i])
    check_finished(req, token, sched.tokenizer)
    finish_on_grammar(req, token)
    if req.to_abort is not None and not req.finished():
        req.abort(req.to_abort)
    sched.out.stream_token(req)


def _check_chunked(sched: ResultState, req: Req) -> None:
    """Between two chunks: an aborted request, or one the role stops (its transfer failed), ends here."""
    stop = sched.role.chunk_stop(req)
    if stop is None and req.to_abort is not None:
        stop = (req.to_abort, ErrorCode.CANCELLED)
    if stop is None:
        return
    if sched.chunked_req is req:
        sched.chunked_req = None
    req.abort(*stop)
    sched.finish_req(req)
