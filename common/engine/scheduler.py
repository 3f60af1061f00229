"""The scheduler of one rank: SGLang's loop over a ``ModelRunner``, a prefix cache and the owners of its queues.

Lifecycle of a colocated request: waiting -> (chunked) prefill -> running (decode) -> finished.

    step:  role.begin_step -> process_input_requests -> role.poll -> get_next_batch_to_run -> run_batch
           -> process_batch_result (-> finish_req)
    get_next_batch_to_run:  decode.merge_last_batch()
                            batch = prefill.next_batch(running batch) or decode.next_batch()

Who holds what (``common.engine``): ``intake`` (``RequestIntake``) the requests in flight by rid; ``prefill``
(``PrefillManager``) the waiting queue, preempted requests, the chunked request, ``new_token_ratio`` and the
``SchedulePolicy``; ``decode`` (``DecodeManager``) the running batch, the last batch, retraction and the speculator;
``worker`` (``ModelWorker``) the forward thread and the batch in flight; ``out`` (``OutputCollector``) the step's
outputs; ``metrics`` (``RankMetrics``) the load report and log lines. The scheduler runs the loop, takes each result
(``process_batch_result``) and finishes requests (``finish_req``, the one finish path); the prefill and decode nodes
plug their queues in through the hooks of ``common.engine.scheduler_role.SchedulerRole``.

Overlap schedule (default, but see ``overlap_schedule_on`` for CPU; ``--disable-overlap-schedule`` keeps the loop
above): batch k runs on a forward thread while this thread processes batch k-1's results and prepares batch k+1
from batch k's future tokens (``common.engine.overlap``)::

    step k: process_input_requests -> get_next_batch_to_run (k) -> launch k -> process_batch_result (k-1)

A request therefore runs one step past its end at most (that token is dropped); one whose pending token ends it by
length is left out of the next batch. Penalties read every output token, so a batch holding a penalised request
has its results processed before the next batch is prepared; a role that reads a batch's KV pages between steps
(``waits_for_forward``: the prefill node) has its forward finish before the next batch is prepared. The KV pages
that batch k-1's results free while batch k runs become allocatable only once batch k's result is obtained
(``common.engine.model_worker``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from common.config import ServerArgs
from common.engine.decode_manager import DecodeManager
from common.engine.distributed import TPGroup
from common.engine.io_struct import AbortReq, GenerateReqInput, LoadOut, LoadReq, QueueLoad, SchedulerInput
from common.engine.mem.hicache import build_prefix_cache
from common.engine.model_runner import BatchResult, ModelRunner
from common.engine.model_worker import ModelWorker
from common.engine.overlap import overlap_schedule_on
from common.engine.prefill_manager import PrefillManager
from common.engine.req import Req
from common.engine.request_intake import RequestIntake
from common.engine.sampling.grammar import GrammarCompiler, tokenizer_info
from common.engine.sampling.grammar_queue import GrammarQueue
from common.engine.schedule_batch import ScheduleBatch
from common.engine.scheduler_metrics import RankMetrics
from common.engine.scheduler_output import OutputCollector
from common.engine.scheduler_role import ColocatedRole, SchedulerRole
from common.engine.spec import build_speculator
from common.errors import ErrorCode, internal_error_message
from common.faults import inject

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        model_path: str,
        tokenizer: Any,
        send_outputs: Callable[[list[Any]], None],
        dp_rank: int = 0,
        tp: TPGroup | None = None,
        role: SchedulerRole | None = None,
    ) -> None:
        self.args = args
        self.dp_rank = dp_rank
        self.tp = tp or TPGroup(dp_rank=dp_rank)
        self.tokenizer = tokenizer
        self.runner = ModelRunner(args, model_path, dp_rank, tp=self.tp)
        self.model_config = self.runner.model_config
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.allocator = self.runner.allocator
        speculator = build_speculator(args, self.runner, dp_rank)  # None: --speculative-algorithm off
        self.worker = ModelWorker(self.runner)
        self.overlap = overlap_schedule_on(args, self.runner.device)
        self.tree_cache: Any = build_prefix_cache(args, self.runner, self.tp, self.worker.last_launched,
                                                  self.model_config)
        self.role: SchedulerRole = role or ColocatedRole()
        self.out = OutputCollector(send_outputs, args.stream_interval)
        self.metrics = RankMetrics(args, self.tp, dp_rank, self.allocator, self.req_to_token_pool, self.tree_cache,
                                   self.runner.max_total_num_tokens, self.role.queue_counts)
        pools = (self.tree_cache, self.allocator, self.req_to_token_pool)
        self.prefill = PrefillManager(args, *pools, self.metrics, self.role.on_chunk_done)
        self.decode = DecodeManager(args, *pools, self.prefill, speculator, self.metrics,
                                    self.worker.reclaim_deferred_pages)
        self.request_log_level = logging.INFO if args.log_requests else logging.DEBUG
        self.intake = RequestIntake(self.model_config, self.runner.max_total_num_tokens, self.out,
                                    self.request_log_level, self.prefill.policy.resolve_priority,
                                    lambda key: self.grammar_compiler.matcher(key))
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first grammar request
        self.grammar_queue = GrammarQueue(lambda: self.grammar_compiler, self.tp, args.grammar_compile_timeout,
                                          enabled=args.grammar_backend != "none")
        self.role.bind(self)

    @property
    def max_total_num_tokens(self) -> int:
        return self.runner.max_total_num_tokens

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            info = tokenizer_info(self.tokenizer, self.model_config.vocab_size, list(self.model_config.eos_token_ids))
            self._grammar_compiler = GrammarCompiler(info, any_whitespace=self.args.grammar_any_whitespace,
                                                     workers=self.args.grammar_compile_workers,
                                                     timeout_s=self.args.grammar_compile_timeout)
        return self._grammar_compiler

    def close(self) -> None:
        """Stop the forward thread (after its batch), then release what the role holds (its KV manager)."""
        self.worker.close()
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()
        self.tree_cache.close()
        if self.decode.speculator is not None:
            self.decode.speculator.close()
        self.role.close()

    # -- the loop: one iteration of the seeds' event_loop_normal / event_loop_overlap ------------------------------
    def step(self, msgs: list[SchedulerInput]) -> bool:
        """One iteration of the loop of every role; returns whether a batch ran or its results were processed."""
        self.role.begin_step()
        if self.is_idle():
            self.metrics.decode_log.restart()
        self.prefill.begin_step()
        self.process_input_requests(msgs)
        self.admit_compiled()
        self.role.poll()
        self.out.flush()  # first tokens of requests that joined here (a decode node's transfers): not after a forward
        ran = self.step_overlap() if self.overlap else self.step_normal()
        self.out.flush()
        return ran

    def step_normal(self) -> bool:
        batch = self.get_next_batch_to_run()
        if batch is not None:
            self.process_batch_result(batch, self.run_batch(batch))
        return batch is not None

    def step_overlap(self) -> bool:
        """One overlapped step: the last step's batch is in flight while this one's is chosen and launched; its
        results are processed after that launch, with the pages they free deferred (``common.engine.model_worker``)."""
        worker = self.worker
        prev = worker.take_in_flight()
        if prev is not None and any(_reads_output_history(r) for r in prev.batch.reqs):
            self.process_batch_result(prev.batch, worker.result(prev.future))
            prev = None
        elif prev is not None and self.role.waits_for_forward():
            worker.result(prev.future)  # NOTE: its results are still processed after the next launch
        batch = self.get_next_batch_to_run()
        if batch is not None:
            worker.launch(batch)
        if prev is not None:
            result = worker.result(prev.future)
            with self.allocator.defer_frees() if worker.in_flight is not None else contextlib.nullcontext():
                self.process_batch_result(prev.batch, result)
        worker.end_step()
        return batch is not None or prev is not None

    def is_idle(self) -> bool:
        """Nothing queued, running or in flight, in the engine or in the role's queues."""
        return (not self.grammar_queue and self.prefill.is_idle() and self.decode.is_idle()
                and self.worker.in_flight is None and self.role.is_idle())

    # -- input -----------------------------------------------------------------------------------------------------
    def process_input_requests(self, msgs: list[SchedulerInput]) -> None:
        """The one dispatch of every role: what a message does to the queues is the role's."""
        for msg in msgs:
            if isinstance(msg, GenerateReqInput):
                if msg.sampling_params.grammar_key is not None:
                    self.intake.hold_for_grammar(msg, self.grammar_queue)  # until compiled: admit_compiled
                else:
                    self.admit(msg)
            elif isinstance(msg, AbortReq):
                if self.grammar_queue.remove(msg.rid):
                    self.out.error(msg.rid, msg.reason, msg.code)
                else:
                    self.role.abort(msg.rid, msg.reason, msg.code)
            elif isinstance(msg, LoadReq):
                load = self.get_load()
                self.role.fill_load(load)
                self.out.send_now([LoadOut(load=load)])

    def admit(self, msg: GenerateReqInput) -> None:
        try:
            self.role.admit(msg)
        except Exception as e:  # one bad request fails alone; nothing of it was queued
            self.intake.fail_input(msg.rid, e)

    def admit_compiled(self) -> None:
        """Requests whose grammar every rank has compiled go to their role; expired ones fail."""
        for msg in self.grammar_queue.pop_ready(self.out.error):
            self.admit(msg)

    def get_load(self) -> QueueLoad:
        """This replica's load (a TP collective: every rank answers the same ``LoadReq``); the role adds its queues."""
        prefill, running = self.prefill, self.decode.running_batch.reqs
        by_priority = prefill.policy.queue_by_priority
        return self.metrics.load(
            running=len(running) + (1 if prefill.chunked_req else 0),
            waiting=len(prefill.waiting_queue) + len(self.grammar_queue),
            queue_by_priority={"waiting": by_priority(prefill.waiting_queue), "running": by_priority(running)},
            preemptions=prefill.policy.num_preempted,
        )

    # -- batching --------------------------------------------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """The seeds' ``get_next_batch_to_run``: the last prefill batch joins the running batch, then a new prefill
        batch if one forms, else the running batch's next decode (or draft -> verify) step."""
        self.decode.merge_last_batch()
        batch = self.prefill.next_batch(self.decode.running_batch) or self.decode.next_batch()
        self.decode.last_batch = batch
        return batch

    def run_batch(self, batch: ScheduleBatch) -> BatchResult:
        return self.worker.run(batch)

    # -- results ---------------------------------------------------------------------------------------------------
    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
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
                self._check_chunked(req)
                continue
            prefilled = is_prefill and id(req) not in decoding
            try:
                self._append_tokens(batch, req, result, i)
                if prefilled:
                    self.role.on_prefill_done(req)
            except Exception as e:
                self.fail_req(req, e)
                continue
            if req.finished():
                self.finish_req(req)
            elif prefilled:
                self.tree_cache.cache_unfinished_req(req)
        if not is_prefill:
            self.metrics.log_decode(self.decode.running_batch.reqs, self.decode.speculator is not None)
        self.out.flush()

    def _append_tokens(self, batch: ScheduleBatch, req: Req, result: BatchResult, i: int) -> None:
        """Row i's token; in a verify step, request i's accepted run, token by token until one ends it (no token
        after a stop is emitted), then the rejected drafts' KV is given back (``common.engine.spec.info``)."""
        spec = batch.spec_info
        if spec is None:
            self._append_token(req, result, i)
            return
        before = len(req.output_ids)
        try:
            for row in spec.accepted_rows(i, result.next_token_ids):
                self._append_token(req, result, row)
                if req.finished():
                    break
        finally:
            spec.commit(batch, req, i, len(req.output_ids) - before, self.metrics.decode_log)

    def _append_token(self, req: Req, result: BatchResult, row: int) -> None:
        inject("token", req.rid)
        logprobs, top = result.logprobs, result.top_logprobs
        if not req.take_token(result.next_token_ids[row], self.tokenizer, None if logprobs is None else logprobs[row],
                              None if top is None else top[row]):
            return
        self.metrics.decode_log.tokens += 1
        if req.to_abort is not None and not req.finished():
            req.abort(req.to_abort)
        self.out.stream_token(req)

    def _check_chunked(self, req: Req) -> None:
        """Between two chunks: an aborted request, or one the role stops (its transfer failed), ends here."""
        stop = self.role.chunk_stop(req)
        if stop is None and req.to_abort is not None:
            stop = (req.to_abort, ErrorCode.CANCELLED)
        if stop is None:
            return
        self.prefill.drop_chunked(req)
        req.abort(*stop)
        self.finish_req(req)

    # -- the request operations of the roles (``scheduler_role.Engine``) --------------------------------------------
    def finish_req(self, req: Req, release: bool = True) -> None:
        """The one finish path: hand the request's KV to the prefix cache (or free it) and report its outcome.

        With ``release``, a role may keep the pages (a KV transfer still reads them): the request then stays the
        role's until it calls ``finish_req`` again.
        """
        if release and req.req_pool_idx is not None:
            if self.role.keep_pages_on_finish(req):
                return
            self.tree_cache.cache_finished_req(req)
            self.decode.running_batch.batch_is_full = False  # memory came back: the queue may fit again
        req.times.finished = time.monotonic()
        self.intake.reqs_by_rid.pop(req.rid, None)
        if self.role.on_finish(req):
            return
        self.log_request_end(req, req.finished_reason.reason.value if req.finished_reason else "abort")
        self.out.finish(req)

    def fail_req(self, req: Req, exc: Exception) -> None:
        """An unexpected error while handling one request's result: it finishes with INTERNAL and its KV and slot
        are released; the rest of the batch and the rank carry on."""
        logger.exception("rid=%s room=%s: internal error; the request fails, the rank keeps serving",
                         req.rid, req.bootstrap_room, exc_info=exc)
        self.prefill.drop_chunked(req)
        req.finished_reason = None
        req.abort(internal_error_message(exc), ErrorCode.INTERNAL)
        self.finish_req(req)

    def log_request_end(self, req: Req, outcome: str) -> None:
        logger.log(self.request_log_level, "rid=%s room=%s: %s, %d output tokens, %d cached, %.3f s",
                   req.rid, req.bootstrap_room, outcome, len(req.output_ids), req.cached_tokens,
                   time.monotonic() - req.times.arrival)

    def abort_request(self, rid: str, reason: str) -> None:
        """Waiting requests leave at once; a request in a batch finishes as ABORT at its next result."""
        req = self.intake.find(rid)
        if req is None:
            return
        if self.prefill.remove(req):
            req.abort(reason)
            self.finish_req(req, release=False)
        else:
            req.to_abort = reason

    def add_prebuilt(self, reqs: list[Req], take_first_token: Callable[[Req], None]) -> None:
        """Requests whose prompt KV and first token were computed elsewhere (a decode node's transfers): each gets its
        first token from ``take_first_token``, then joins the running batch or finishes at once."""
        running = []
        for req in reqs:
            try:
                take_first_token(req)
            except Exception as e:  # this request fails with INTERNAL and frees its pages; the rank carries on
                self.fail_req(req, e)
                continue
            if req.finished():
                self.finish_req(req)
            else:
                self.out.stream_token(req)
                running.append(req)
        self.decode.add_prebuilt(running)

    def preempt_running(self, victims: list[Req], head: Req) -> None:
        """Priority preemption for ``head`` (a role's queued request): ``victims`` leave the running batch and wait
        from the next step to recompute. NOTE: their pages are deferred while a batch is in flight (it may still
        write the victims' next slots, and the role hands freed pages to another process's writer)."""
        with self.allocator.defer_frees() if self.worker.in_flight is not None else contextlib.nullcontext():
            self.decode.preempt(victims, head)


def _reads_output_history(req: Req) -> bool:
    """Its next draw reads every output token so far (penalties, a grammar's matcher), not only the last one."""
    sp = req.sampling_params
    return sp.has_penalty or bool(sp.min_new_tokens) or req.grammar is not None


__all__ = ["Scheduler"]
