"""``OutputCollector``: the ``TokenOut`` messages a scheduler step produces, handed to the sink in one call per step,
and ``req_timing``, a finished request's timing breakdown. What a batch's result does to each request is the
scheduler's ``process_batch_result``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.engine.io_struct import Timing, TokenOut
from common.engine.req import Req
from common.errors import ErrorCode


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
