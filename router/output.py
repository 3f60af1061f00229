"""Per-attempt output state: incremental detokenization, stop strings, logprobs, TTFT/ITL, and the final result."""

from __future__ import annotations

import time
from typing import Any

from common.text.detokenizer import IncrementalDetokenizer
from pdcluster.v1 import common_pb2, worker_pb2
from router.metrics import RouterMetrics
from router.request import Delta, Final, GenRequest

TIMING_FIELDS = ("queue", "bootstrap", "prefill", "transfer", "decode_queue", "ttft", "e2e")


def timing_dict(t: common_pb2.Timing | None) -> dict[str, float]:
    if t is None:
        return {}
    d = {f: getattr(t, f) for f in TIMING_FIELDS}
    d["transfer_bytes"] = t.transfer_bytes
    if t.cached_tokens_host or t.cached_tokens_storage:  # a hierarchical cache's hits below the device
        d["cached_tokens_host"], d["cached_tokens_storage"] = t.cached_tokens_host, t.cached_tokens_storage
    return d


class OutputState:
    def __init__(self, req: GenRequest, tokenizer: Any, metrics: RouterMetrics) -> None:
        self.req = req
        self.metrics = metrics
        sp = req.sampling
        self.detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop
        )
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[common_pb2.TopLogprobs] = []
        self.first_at: float | None = None
        self.last_at = 0.0
        self.router_end: tuple[str, int | None] | None = None  # set by ``end_at_router``

    @property
    def stopped(self) -> bool:
        """A stop string matched at the router (the node may still be generating)."""
        return self.detok.stopped

    def add(self, chunk: worker_pb2.TokenChunk, final: bool = False) -> Delta | None:
        """Streaming requests get a Delta per chunk; the others are detokenized once, at the final chunk."""
        ids = list(chunk.token_ids)
        if not ids and not final:
            return None
        if not self.req.stream and not final and not self.detok.stop:
            self._note_arrival()
            self.ids.extend(ids)
            self.logprobs.extend(chunk.logprobs)
            self.top_logprobs.extend(chunk.top_logprobs)
            return None
        if ids:
            self._note_arrival()
        if self.detok.stopped:
            return None
        self.ids.extend(ids)
        text = self.detok.add(self.ids[len(self.detok.ids) :], final=final)
        if not chunk.logprobs and not chunk.top_logprobs:  # no logprobs asked for: nothing to copy
            return Delta(text, ids, [], [])
        lps = list(chunk.logprobs)
        tops = list(chunk.top_logprobs)
        self.logprobs.extend(lps)
        self.top_logprobs.extend(tops)
        return Delta(text, ids, lps, tops)

    def end_at_router(self, reason: str, matched_token: int | None) -> Delta:
        """End the request without a Finished message (its last leg failed after sending its last token); the
        Delta holds the text held back until now."""
        self.router_end = (reason, matched_token)
        text = self.detok.add(self.ids[len(self.detok.ids) :], final=True)
        return Delta(text, [])

    def _note_arrival(self) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            self.metrics.ttft.observe(now - self.req.arrival)
        else:
            self.metrics.itl.observe(now - self.last_at)
        self.last_at = now

    def matched_stop(self) -> str | None:
        return self.detok.matched_stop()

    def finish(
        self,
        fin: worker_pb2.Finished | None,
        prefill: worker_pb2.PrefillResponse | None,
        served_by: str,
        attempts: int,
        dispatched_at: float,
        migrations: list[dict[str, Any]],
    ) -> Final:
        """``fin`` None: the router ended the request itself (a stop string matched, or ``end_at_router``).
        ``prefill`` and ``dispatched_at`` are of the attempt that produced the first token; ``fin`` of the last;
        ``migrations``: one entry per migration, in order."""
        now = time.monotonic()
        req = self.req
        matched_token: int | None = None
        matched_stop: str | None = None
        if self.detok.stopped:
            reason, matched_stop = "stop", self.matched_stop()
        elif fin is None and self.router_end is not None:
            reason, matched_token = self.router_end
        else:
            assert fin is not None
            reason = fin.finish_reason or "stop"
            which = fin.WhichOneof("matched")
            if which == "matched_token":
                matched_token = fin.matched_token
            elif which == "matched_stop":
                matched_stop = fin.matched_stop
        cached = prefill.cached_tokens if prefill is not None else (fin.usage.cached_tokens if fin else 0)
        p_t = prefill.timing if prefill is not None else None
        d_t = fin.timing if fin is not None else None
        ttft = (self.first_at or now) - req.arrival
        e2e = now - req.arrival
        merged = common_pb2.Timing(ttft=ttft, e2e=e2e)
        src = p_t if p_t is not None else (d_t if not migrations else None)
        if src is not None:
            merged.queue, merged.bootstrap, merged.prefill = src.queue, src.bootstrap, src.prefill
            merged.cached_tokens_host, merged.cached_tokens_storage = src.cached_tokens_host, src.cached_tokens_storage
        # NOTE: after a migration ``d_t`` is a later attempt's: its transfer and queue are not part of the TTFT.
        if d_t is not None and not migrations:
            merged.transfer, merged.decode_queue = d_t.transfer, d_t.decode_queue
            merged.transfer_bytes = d_t.transfer_bytes
        if p_t is not None and p_t.transfer > 0:
            # P's view (prefill done -> KV sent) follows its prefill; D's (pages sent -> KV received) overlaps it
            merged.transfer = p_t.transfer
            merged.transfer_bytes = merged.transfer_bytes or p_t.transfer_bytes
        timing: dict[str, Any] = timing_dict(merged)
        router_queue = dispatched_at - req.arrival  # tokenize + routing + retries/backoff
        parts = router_queue + merged.bootstrap + merged.queue + merged.prefill + merged.transfer
        timing.update(
            tokenize=req.tokenize_s,
            router_queue=router_queue,
            # TTFT = router_queue + bootstrap + queue + prefill + transfer + ttft_other (RPC/IPC hops, D's first
            # step); e2e = ttft + decode
            ttft_other=ttft - parts,
            decode=e2e - ttft,
            attempts=attempts,
            migrations=len(migrations),
            migrated=migrations,
            prefill_node=timing_dict(p_t),
            decode_node=timing_dict(d_t),
        )
        self.metrics.e2e.observe(e2e)
        self.metrics.prompt_tokens.inc(len(req.input_ids))
        self.metrics.completion_tokens.inc(len(self.ids))
        self.metrics.cached_tokens.inc(cached)
        return Final(
            rid=req.rid,
            text=self.detok.text,
            output_ids=self.ids,
            finish_reason=reason,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(self.ids),
            cached_tokens=cached,
            served_by=served_by,
            timing=timing,
            matched_token=matched_token,
            matched_stop=matched_stop,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            node_timing=merged,
            spec=fin.spec if fin is not None and fin.HasField("spec") else None,
        )
