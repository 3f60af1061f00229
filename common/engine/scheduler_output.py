"""Builds the ``TokenOut`` messages a scheduler step produces and hands them to the sink in one call per step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.engine.req import Req
from common.errors import ErrorCode
from common.io_struct import Timing, TokenOut


def req_timing(req: Req) -> Timing:
    t = req.times
    first = t.first_token or t.finished
    timing = Timing(
        ttft=max(0.0, first - t.arrival),
        e2e=max(0.0, t.finished - t.arrival) if t.finished else 0.0,
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
    def __init__(self, sink: Callable[[list[Any]], None]) -> None:
        self.sink = sink
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
        if not req.finished():
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
        self.pending.append(out)

    def error(self, rid: str, message: str, code: ErrorCode) -> None:
        self.pending.append(TokenOut(rid=rid, token_ids=[], finish_reason="abort", error=message, error_code=code))

    def send_now(self, msgs: list[Any]) -> None:
        self.sink(msgs)

    def flush(self) -> None:
        if self.pending:
            msgs, self.pending = self.pending, []
            self.sink(msgs)
