"""The scheduler of one rank: SGLang's loop over a ``ModelRunner``, a prefix cache and a waiting queue.

Lifecycle of a colocated request: waiting -> (chunked) prefill -> running (decode) -> finished.

    loop: role.begin_step -> process_input_requests -> role.poll -> get_next_batch_to_run -> run_batch
          -> process_batch_result (-> finish_req)

Overlap schedule (default, but see ``overlap_schedule_on`` for CPU; ``--disable-overlap-schedule`` keeps the loop
above): batch k runs on a forward thread while this thread processes batch k-1's results and prepares batch k+1
from batch k's future tokens (``common.engine.overlap``)::

    step k: process_input_requests -> get_next_batch_to_run (k) -> launch k -> process_batch_result (k-1)

A request therefore runs one step past its end at most (that token is dropped); one whose pending token ends it by
length is left out of the next batch. Penalties read every output token, so a batch holding a penalised request
has its results processed before the next batch is prepared; a role that reads a batch's KV pages between steps
(``waits_for_forward``: the prefill node) has its forward finish before the next batch is prepared.
The KV pages that batch k-1's results free while batch k runs (which may still write them) become allocatable only
once batch k's result is obtained (``step_overlap``).

This is the one loop of every role: the prefill and decode nodes hold a ``Scheduler`` and plug their queues in
through the hooks of ``common.engine.scheduler_role.SchedulerRole``, asked at fixed points of ``step`` (see there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from common.config import ServerArgs
from common.engine.admission import RequestIntake
from common.engine.distributed import TPGroup
from common.engine.mem.chunk_cache import ChunkCache
from common.engine.mem.radix_cache import RadixCache
from common.engine.model_runner import BatchResult, ModelRunner, PendingBatchResult
from common.engine.overlap import overlap_schedule_on
from common.engine.req import FinishReason, Req
from common.engine.sampling.grammar import GrammarCompiler, accept_grammar_token, finish_on_grammar
from common.engine.sampling.grammar_queue import GrammarQueue
from common.engine.sampling.sampler import SamplingBatchInfo
from common.engine.sampling.stop import check_finished
from common.engine.schedule_batch import ModelWorkerBatch, ScheduleBatch
from common.engine.schedule_order import SchedulePolicy
from common.engine.schedule_policy import AddReqResult, PrefillAdder
from common.engine.scheduler_metrics import (
    DecodeLogInterval,
    DecodeStats,
    PrefillStats,
    format_decode_line,
    format_prefill_line,
)
from common.engine.scheduler_output import OutputCollector
from common.engine.scheduler_role import ColocatedRole, SchedulerRole
from common.errors import CapacityError, ErrorCode, InvalidRequestError, internal_error_message
from common.faults import inject
from common.io_struct import AbortReq, GenerateReqInput, LoadOut, LoadReq, QueueLoad, SchedulerInput

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


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
        self.page_size = args.page_size
        if not args.use_radix_cache:
            self.tree_cache: Any = ChunkCache(self.req_to_token_pool, self.allocator, self.page_size)
        else:
            self.tree_cache = RadixCache(self.req_to_token_pool, self.allocator, self.page_size)
        self.out = OutputCollector(send_outputs)
        self.waiting_queue: list[Req] = []
        self.policy = SchedulePolicy(args, self.tree_cache, self.allocator, self.req_to_token_pool)
        self.running_batch = self.new_batch([])
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.overlap = overlap_schedule_on(args, self.runner.device)
        self.forward_thread: ThreadPoolExecutor | None = None  # created by the first overlapped launch
        self.in_flight: tuple[ScheduleBatch, Future[PendingBatchResult]] | None = None  # launched, results unprocessed
        self.awaited: Future[PendingBatchResult] | None = None  # within step_overlap: the batch launched by the last step
        self.reqs_by_rid: dict[str, Req] = {}
        self.init_new_token_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness)
        self.min_new_token_ratio = self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio
        self.forward_ct = 0
        self.num_retracted = 0
        self.request_log_level = logging.INFO if args.log_requests else logging.DEBUG
        self.intake = RequestIntake(self.model_config, self.runner.max_total_num_tokens, self.out, self.reqs_by_rid,
                                    self.request_log_level, self.policy.resolve_priority,
                                    lambda key: self.grammar_compiler.matcher(key))
        self.decode_log = DecodeLogInterval(args.decode_log_interval)
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first grammar request
        self.grammar_queue = GrammarQueue(lambda: self.grammar_compiler, self.tp, args.grammar_compile_timeout,
                                          enabled=args.grammar_backend != "none")
        self.role: SchedulerRole = role or ColocatedRole()
        self.role.bind(self)

    # -- construction helpers --------------------------------------------------------------------------------------
    def new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch.init_new(reqs, self.req_to_token_pool, self.allocator, self.tree_cache)

    @property
    def max_total_num_tokens(self) -> int:
        return self.runner.max_total_num_tokens

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.model_config.vocab_size, list(self.model_config.eos_token_ids),
                any_whitespace=self.args.grammar_any_whitespace,
            )
        return self._grammar_compiler

    def close(self) -> None:
        """Stop the forward thread (after its batch), then release what the role holds (its KV manager)."""
        if self.forward_thread is not None:
            self.forward_thread.shutdown(wait=True)
            self.forward_thread = None
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()
        self.role.close()

    # -- the ``Engine`` interface of the roles (``scheduler_role.Engine``) ---------------------------------------------
    def reject(self, rid: str, message: str, code: ErrorCode) -> None:
        self.out.error(rid, message, code)

    def send_now(self, outputs: list[Any]) -> None:
        self.out.send_now(outputs)

    def find_req(self, rid: str) -> Req | None:
        return self.reqs_by_rid.get(rid)

    def enqueue(self, reqs: list[Req]) -> None:
        self.waiting_queue.extend(reqs)

    def num_waiting(self) -> int:
        return len(self.waiting_queue)

    def prefilling_reqs(self) -> list[Req]:
        return [*self.waiting_queue, *([self.chunked_req] if self.chunked_req is not None else [])]

    def running_reqs(self) -> list[Req]:
        return self.running_batch.reqs

    # -- input -----------------------------------------------------------------------------------------------------
    def process_input_requests(self, msgs: list[SchedulerInput]) -> None:
        """The one dispatch of every role: what a message does to the queues is the role's."""
        for msg in msgs:
            if isinstance(msg, GenerateReqInput):
                if msg.sampling_params.grammar_key is not None:
                    self.hold_for_grammar(msg)
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

    def hold_for_grammar(self, msg: GenerateReqInput) -> None:
        """A request with a grammar waits in the grammar queue until it is compiled (``admit_compiled``)."""
        try:
            self.intake.validate(msg)
        except (InvalidRequestError, CapacityError) as e:
            self.out.error(msg.rid, str(e), ErrorCode.INVALID_ARGUMENT)
            return
        refused = (f"request id {msg.rid!r} is already in flight" if msg.rid in self.reqs_by_rid
                   else self.grammar_queue.add(msg))
        if refused is not None:
            self.out.error(msg.rid, refused, ErrorCode.INVALID_ARGUMENT)

    def admit_compiled(self) -> None:
        """Requests whose grammar every rank has compiled go to their role; expired ones fail."""
        for msg in self.grammar_queue.pop_ready(self.out.error):
            self.admit(msg)

    # -- admission (``common.engine.admission``) ---------------------------------------------------------------------
    def build_req(self, msg: GenerateReqInput) -> Req | None:
        return self.intake.build_req(msg)

    def fail_req(self, req: Req, exc: Exception) -> None:
        """An unexpected error while handling one request's result: it finishes with INTERNAL and its KV and slot
        are released; the rest of the batch and the rank carry on."""
        logger.exception("rid=%s room=%s: internal error; the request fails, the rank keeps serving",
                         req.rid, req.bootstrap_room, exc_info=exc)
        if self.chunked_req is req:
            self.chunked_req = None
        req.finished_reason = None
        req.abort(internal_error_message(exc), ErrorCode.INTERNAL)
        self.finish_req(req)

    def abort_request(self, rid: str, reason: str) -> None:
        """Waiting requests leave at once; a request in a batch finishes as ABORT at its next result."""
        req = self.reqs_by_rid.get(rid)
        if req is None:
            return
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
            req.abort(reason)
            self.finish_req(req, release=False)
        else:
            req.to_abort = reason

    def take_waiting(self, leaves: Callable[[Req], bool]) -> list[Req]:
        """Remove and return the waiting requests for which ``leaves`` is true, in queue order."""
        gone = [r for r in self.waiting_queue if leaves(r)]
        for req in gone:
            self.waiting_queue.remove(req)
        return gone

    def add_prebuilt(self, reqs: list[Req], take_first_token: Callable[[Req], None]) -> None:
        """Requests whose prompt KV and first token were computed elsewhere (a decode node's transfers): each
        gets its first token from ``take_first_token``, then joins the running batch or finishes at once."""
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
        if running:
            self.running_batch.merge_batch(self.new_batch(running))

    # -- batching --------------------------------------------------------------------------------------------------
    def merge_last_batch(self) -> None:
        """Fold the last prefill batch into the running batch; the chunked request stays out and is cached.

        NOTE: a request of an overlapped batch whose pending token ends it (a prefill node's, capped at one token)
        is left out by ``filter_batch`` although its result is not processed yet.
        """
        last, self.last_batch = self.last_batch, None
        if last is None or not last.forward_mode.is_extend():
            return
        if self.chunked_req is not None:
            self.tree_cache.cache_unfinished_req(self.chunked_req)
            self.role.on_chunk_done(self.chunked_req)
        last.filter_batch(exclude=self.chunked_req)
        if not last.is_empty():
            self.running_batch.merge_batch(last)
            self.running_batch.batch_is_full = False

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        self.merge_last_batch()
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if not self.running_batch.is_empty():
            self.update_running_batch(self.running_batch)
            if not self.running_batch.is_empty():
                return self.running_batch
        return None

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if self.running_batch.is_empty():
            self.running_batch.batch_is_full = False  # nothing holds memory for decode; always try the queue
        self.policy.prepare(self.waiting_queue, self.running_batch, self.new_token_ratio)
        if (self.running_batch.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        running_bs = len(self.running_batch.reqs)
        if running_bs >= self.args.max_running_requests and self.chunked_req is None:
            self.running_batch.batch_is_full = True
            return None
        mixed = self.args.enable_mixed_chunk and not self.running_batch.is_empty()
        adder = PrefillAdder(
            self.page_size,
            self.tree_cache,
            self.allocator,
            self.running_batch.reqs,
            self.new_token_ratio,
            self.args.max_prefill_tokens,
            self.args.chunk_size,
            running_bs if mixed else 0,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input(None)
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        # Request slots held outside the running batch (a prefill node's inflight queue, a decode node's transfer
        # queue) bound admission too: a request without a slot is admitted only while a free one is left.
        free_slots = self.req_to_token_pool.available_size()
        for req in self.waiting_queue:
            if running_bs + len(adder.can_run_list) >= self.args.max_running_requests or (
                req.req_pool_idx is None and free_slots <= 0
            ):
                self.running_batch.batch_is_full = True
                break
            req.init_next_round_input(self.tree_cache)
            needs_slot = req.req_pool_idx is None
            result = adder.add_one_req(req)
            if needs_slot and adder.can_run_list and adder.can_run_list[-1] is req:
                free_slots -= 1
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    self.running_batch.batch_is_full = True
                break
        if not adder.can_run_list:
            return None
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
        now = time.monotonic()
        for req in adder.can_run_list:
            if not req.times.forward_start:
                req.times.forward_start = now
                req.cached_tokens = len(req.prefix_indices)
        batch = self.new_batch(adder.can_run_list)
        batch.prepare_for_extend()
        batch.chunked_req = self.chunked_req
        self.log_prefill_stats(adder, running_bs)
        if mixed and not batch.return_logprob and not self.running_batch.return_logprob:
            self.running_batch.filter_batch()
            if not self.running_batch.is_empty() and self.running_batch.check_decode_mem():
                batch.mix_with_running(self.running_batch)
                self.running_batch = self.new_batch([])
        return batch

    def update_running_batch(self, batch: ScheduleBatch) -> None:
        batch.filter_batch()
        if batch.is_empty():
            return
        if not batch.check_decode_mem() and not (self.reclaim_deferred_pages() and batch.check_decode_mem()):
            retracted, self.new_token_ratio = batch.retract_decode()
            self.num_retracted += len(retracted)
            self.decode_log.retracted += len(retracted)
            logger.info(
                "KV cache is full: retracted %d requests, #running-req: %d, new_token_ratio: %.4f",
                len(retracted), len(batch.reqs), self.new_token_ratio,
            )
            self.waiting_queue[:0] = retracted
            batch.batch_is_full = False
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        batch.prepare_for_decode()

    def run_batch(self, batch: ScheduleBatch) -> BatchResult:
        return self.runner.forward_and_sample(self.worker_batch(batch))

    def worker_batch(self, batch: ScheduleBatch) -> ModelWorkerBatch:
        """What the runner needs, read from the requests now (the forward may run while they change)."""
        for req in batch.reqs:
            inject("forward", req.rid)
        self.forward_ct += 1
        b = batch.get_model_worker_batch()
        b.sampling_info = SamplingBatchInfo.from_reqs(batch.reqs, self.model_config.vocab_size, self.runner.device)
        return b

    def launch(self, batch: ScheduleBatch) -> Future[PendingBatchResult]:
        """Start ``batch`` on the forward thread. Each row that yields a real token (all but a middle prefill chunk)
        gets a ring slot: the next batch feeds the request that slot's placeholder."""
        future = self.runner.future_tokens
        slots = future.alloc(len(batch.reqs))
        b = self.worker_batch(batch)  # NOTE: before the new slots: sampling reads each row's pending draw step
        b.has_placeholders = any(r.future_slot is not None for r in batch.reqs)
        for i, req in enumerate(batch.reqs):
            if req is batch.chunked_req:
                slots[i] = future.dump_slot
            else:
                req.future_slot = slots[i]
        b.future_slots = batch.future_slots = slots
        if self.forward_thread is None:
            self.forward_thread = ThreadPoolExecutor(1, "pdcluster-forward")
        return self.forward_thread.submit(self.runner.launch, b)

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
                self.append_token(req, result, i)
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
            self.log_decode_stats()
        self.out.flush()

    def append_token(self, req: Req, result: BatchResult, i: int) -> None:
        inject("token", req.rid)
        token = result.next_token_ids[i]
        if not accept_grammar_token(req, token):
            return
        req.output_ids.append(token)
        self.decode_log.tokens += 1
        if not req.times.first_token:
            req.times.first_token = time.monotonic()
        if req.return_logprob and result.logprobs is not None:
            req.output_logprobs.append(result.logprobs[i])
            if result.top_logprobs is not None:
                req.output_top_logprobs.append(result.top_logprobs[i])
        check_finished(req, token, self.tokenizer)
        finish_on_grammar(req, token)
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
        if self.chunked_req is req:
            self.chunked_req = None
        req.abort(*stop)
        self.finish_req(req)

    def finish_req(self, req: Req, release: bool = True) -> None:
        """The one finish path: hand the request's KV to the prefix cache (or free it) and report its outcome.

        With ``release``, a role may keep the pages (a KV transfer still reads them): the request then stays the
        role's until it calls ``finish_req`` again.
        """
        if release and req.req_pool_idx is not None:
            if self.role.keep_pages_on_finish(req):
                return
            self.tree_cache.cache_finished_req(req)
            self.running_batch.batch_is_full = False  # memory came back: the queue may fit again
        req.times.finished = time.monotonic()
        self.reqs_by_rid.pop(req.rid, None)
        if self.role.on_finish(req):
            return
        self.log_request_end(req, req.finished_reason.reason.value if req.finished_reason else "abort")
        self.out.finish(req)

    def log_request_end(self, req: Req, outcome: str) -> None:
        logger.log(self.request_log_level, "rid=%s room=%s: %s, %d output tokens, %d cached, %.3f s",
                   req.rid, req.bootstrap_room, outcome, len(req.output_ids), req.cached_tokens,
                   time.monotonic() - req.times.arrival)

    # -- the loop --------------------------------------------------------------------------------------------------
    def step(self, msgs: list[SchedulerInput]) -> bool:
        """One iteration of the loop of every role; returns whether a batch ran or its results were processed."""
        self.role.begin_step()
        if self.is_idle():
            self.decode_log.restart()
        self.process_input_requests(msgs)
        self.admit_compiled()
        self.role.poll()
        ran = self.step_overlap() if self.overlap else self.step_normal()
        self.out.flush()
        return ran

    def step_normal(self) -> bool:
        batch = self.get_next_batch_to_run()
        if batch is not None:
            self.process_batch_result(batch, self.run_batch(batch))
        self.last_batch = batch
        return batch is not None

    def step_overlap(self) -> bool:
        """One overlapped step. KV pages freed by a batch's results while the next batch is in flight are deferred.

        Invariants (the hazard: ``common.engine.mem.allocator``, deferred frees):
        - Pages freed while ``process_batch_result`` runs with a batch in flight (finished and failed requests)
          become allocatable only once that batch's result is obtained (``batch_result``). That batch may still
          write a finished request's next KV slot into them, and a writer in another process (a prefill node
          filling pages a decode node preallocated: CUDA IPC, RDMA) is not ordered after it on this rank's
          device stream.
        - Deferred pages exist only from that processing until the next step obtains the in-flight batch's
          result, so only while ``in_flight`` is set: the pools' free counts are whole whenever the scheduler is
          idle.
        - Short of KV for the next decode step, the scheduler first obtains the awaited batch's result
          (``reclaim_deferred_pages``: one step without overlap) rather than retract for pages merely deferred.
        - The step's other frees (aborts and transfer failures in the role's hooks; retraction and radix
          evictions in ``get_next_batch_to_run``) stay immediate: this rank's own next batch is ordered after the
          in-flight one on the device stream, and pages reach another process's writer only through
          ``role.poll`` (a decode node's preallocation), which runs after the step that obtains the in-flight
          result. A decode node has no radix cache (``ServerArgs.use_radix_cache``), so no evicted page there can
          hold a slot an in-flight batch writes.
        - Every role defers alike (it costs a list append). Only a decode node needs it: a prefill node's pages
          are read, not written, by other processes, and only while it keeps them (until the transfer ends); its
          own next forward reusing a freed page is ordered after the in-flight one.
        - Request slots (``req_to_token`` rows) are freed at once: no other process writes them, and a new
          owner's row reaches the device with a later batch, after the in-flight one.
        """
        prev, self.in_flight = self.in_flight, None
        self.awaited = None if prev is None else prev[1]
        if prev is not None and any(_reads_output_history(r) for r in prev[0].reqs):
            self.process_batch_result(prev[0], self.batch_result(prev[1]))
            prev = None
        elif prev is not None and self.role.waits_for_forward():
            self.batch_result(prev[1])  # NOTE: its results are still processed after the next launch
        batch = self.get_next_batch_to_run()
        if batch is not None:
            future = self.launch(batch)
            self.in_flight = (batch.copy(), future)
        if prev is not None:
            result = self.batch_result(prev[1])
            if self.in_flight is None:
                self.process_batch_result(prev[0], result)
            else:
                with self.allocator.defer_frees():
                    self.process_batch_result(prev[0], result)
        self.last_batch = batch
        self.awaited = None
        return batch is not None or prev is not None

    def reclaim_deferred_pages(self) -> bool:
        """Under KV pressure (before retracting): wait for the batch launched by the last step, which makes the
        pages deferred while it was in flight allocatable. Whether any were."""
        if self.awaited is None or self.allocator.num_deferred_pages == 0:
            return False
        self.batch_result(self.awaited)
        return True

    def batch_result(self, future: Future[PendingBatchResult]) -> BatchResult:
        """A launched batch's result; the pages freed while it was in flight become allocatable.

        NOTE: ``PendingBatchResult.wait`` returns once the sampled tokens, copied to the host on the forward's
        stream after all of the batch's kernels, have landed (the step's one sync): its KV writes have completed.
        """
        result = future.result().wait()
        self.allocator.release_deferred()
        return result

    def is_idle(self) -> bool:
        """Nothing queued, running or in flight, in the engine or in the role's queues."""
        return not self.waiting_queue and not self.grammar_queue and self.running_batch.is_empty() and (
            self.chunked_req is None) and self.last_batch is None and self.in_flight is None and self.role.is_idle()

    # -- observability ---------------------------------------------------------------------------------------------
    def token_usage(self) -> float:
        return self.num_used_tokens() / self.runner.max_total_num_tokens

    def get_load(self) -> QueueLoad:
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
        return QueueLoad(
            dp_rank=self.dp_rank,
            running=len(self.running_batch.reqs) + (1 if self.chunked_req else 0),
            waiting=len(self.waiting_queue) + len(self.grammar_queue),
            free_kv_pages=free_kv // self.page_size,
            total_kv_pages=self.runner.max_total_num_tokens // self.page_size,
            free_req_slots=free_slots,
            total_req_slots=self.req_to_token_pool.size,
            token_usage=self.token_usage(),
            evictable_tokens=evictable,
            queue_by_priority={"waiting": self.policy.queue_by_priority(self.waiting_queue),
                               "running": self.policy.queue_by_priority(self.running_batch.reqs)},
            preemptions=self.policy.num_preempted,
        )

    def num_used_tokens(self) -> int:
        """KV slots held by requests (the prefix cache's evictable slots count as free)."""
        return self.runner.max_total_num_tokens - self.allocator.available_size() - self.tree_cache.evictable_size()

    def log_prefill_stats(self, adder: PrefillAdder, running_bs: int) -> None:
        """One line per prefill batch, after admission: the queue no longer holds the batch's requests."""
        if not logger.isEnabledFor(logging.INFO):
            return
        logger.info(format_prefill_line(PrefillStats(
            new_seq=len(adder.can_run_list),
            new_token=adder.log_input_tokens,
            cached_token=adder.log_hit_tokens,
            token_usage=self.token_usage(),
            running_req=running_bs,
            queue_req=len(self.waiting_queue),
            queues=self.role.queue_counts(),
        )))

    def log_decode_stats(self) -> None:
        """One line every ``--decode-log-interval`` decode steps, with the interval's gen throughput."""
        if not self.decode_log.on_decode_step():
            return
        throughput, retracted = self.decode_log.take()
        if not logger.isEnabledFor(logging.INFO):
            return
        logger.info(format_decode_line(DecodeStats(
            running_req=sum(not r.finished() for r in self.running_batch.reqs),
            token=self.num_used_tokens(),
            token_usage=self.token_usage(),
            retracted_req=retracted,
            gen_throughput=throughput,
            queues=self.role.queue_counts(),
        )))


def _reads_output_history(req: Req) -> bool:
    """Its next draw depends on every output token so far (penalties, a grammar's matcher), not only on the last
    one."""
    sp = req.sampling_params
    return sp.has_penalty or bool(sp.min_new_tokens) or req.grammar is not None


def finish_reason_name(req: Req) -> str | None:
    return None if req.finished_reason is None else req.finished_reason.reason.value


__all__ = ["FinishReason", "Scheduler", "finish_reason_name"]
