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
Its parts live beside it in ``common.engine``: request intake (``admission``), batch admission (``batch_admission``),
result processing and outputs (``scheduler_output``), the load report and log lines (``scheduler_metrics``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from common.config import ServerArgs
from common.engine import batch_admission, scheduler_metrics, scheduler_output
from common.engine.admission import RequestIntake
from common.engine.distributed import TPGroup
from common.engine.io_struct import AbortReq, GenerateReqInput, LoadOut, LoadReq, QueueLoad, SchedulerInput
from common.engine.mem.hicache import build_prefix_cache
from common.engine.model_runner import BatchResult, ModelRunner, PendingBatchResult
from common.engine.overlap import overlap_schedule_on
from common.engine.req import Req
from common.engine.sampling.grammar import GrammarCompiler, tokenizer_info
from common.engine.sampling.grammar_queue import GrammarQueue
from common.engine.sampling.sampler import SamplingBatchInfo
from common.engine.schedule_batch import ModelWorkerBatch, ScheduleBatch
from common.engine.schedule_order import SchedulePolicy
from common.engine.scheduler_metrics import DecodeLogInterval
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
        self.page_size = args.page_size
        self.speculator = build_speculator(args, self.runner, dp_rank)  # None: --speculative-algorithm off
        self.tree_cache: Any = build_prefix_cache(args, self.runner, self.tp, self.last_launched, self.model_config)
        self.out = OutputCollector(send_outputs, args.stream_interval)
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
        self.preempted: list[Req] = []  # retracted by a role's queue; waiting from the next step (preempt_running)
        self.yield_to_role = False  # a role's queue preempted this step: no prefill takes what it freed
        ratio = batch_admission.new_token_ratio_schedule(args.schedule_conservativeness)
        self.init_new_token_ratio, self.min_new_token_ratio, self.new_token_ratio_decay = ratio
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
        return ScheduleBatch.init_new(reqs, self.req_to_token_pool, self.allocator, self.tree_cache,
                                      self.args.speculative_algorithm)

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
        if self.forward_thread is not None:
            self.forward_thread.shutdown(wait=True)
            self.forward_thread = None
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()
        self.tree_cache.close()
        if self.speculator is not None:
            self.speculator.close()
        self.role.close()

    # -- the loop: one iteration of the seeds' event_loop_normal / event_loop_overlap ------------------------------
    def step(self, msgs: list[SchedulerInput]) -> bool:
        """One iteration of the loop of every role; returns whether a batch ran or its results were processed."""
        self.role.begin_step()
        if self.is_idle():
            self.decode_log.restart()
        self.waiting_queue[:0], self.preempted = self.preempted, []
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
          result. A decode node's prefix cache (``HeldPrefixCache``) holds only landed or computed prompt pages,
          so no page it frees can hold a slot an in-flight batch writes.
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

    def last_launched(self) -> Future[PendingBatchResult] | None:
        """The batch launched last, while it may still write KV (a hierarchical cache's copies wait for it)."""
        return self.in_flight[1] if self.in_flight is not None else self.awaited

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
        return not self.waiting_queue and not self.grammar_queue and self.running_batch.is_empty() and not (
            self.preempted) and (
            self.chunked_req is None) and self.last_batch is None and self.in_flight is None and self.role.is_idle()

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

    # -- batching (``common.engine.batch_admission``) --------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch_admission.merge_last_batch(self)
        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if not self.running_batch.is_empty():
            self.update_running_batch(self.running_batch)
            if not self.running_batch.is_empty():
                return self.running_batch
        return None

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        return batch_admission.get_new_batch_prefill(self)

    def update_running_batch(self, batch: ScheduleBatch) -> None:
        batch_admission.update_running_batch(self, batch)

    def run_batch(self, batch: ScheduleBatch) -> BatchResult:
        return self.runner.forward_and_sample(self.worker_batch(batch))

    def worker_batch(self, batch: ScheduleBatch) -> ModelWorkerBatch:
        """What the runner needs, read from the requests now (the forward may run while they change)."""
        for req in batch.reqs:
            inject("forward", req.rid)
        self.forward_ct += 1
        b = batch.get_model_worker_batch()
        rows = batch.reqs if batch.spec_info is None else batch.spec_info.sampling_rows(batch.reqs)  # one per token
        b.sampling_info = SamplingBatchInfo.from_reqs(rows, self.model_config.vocab_size, self.runner.device)
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
            # The forward thread runs with this thread's torch thread count (what a compiled step guards on).
            self.forward_thread = ThreadPoolExecutor(1, "pdcluster-forward", initializer=torch.set_num_threads,
                                                     initargs=(torch.get_num_threads(),))
        return self.forward_thread.submit(self.runner.launch, b)

    # -- results (``common.engine.scheduler_output``) --------------------------------------------------------------
    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        scheduler_output.process_batch_result(self, batch, result)

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

    def log_request_end(self, req: Req, outcome: str) -> None:
        logger.log(self.request_log_level, "rid=%s room=%s: %s, %d output tokens, %d cached, %.3f s",
                   req.rid, req.bootstrap_room, outcome, len(req.output_ids), req.cached_tokens,
                   time.monotonic() - req.times.arrival)

    # -- the rest of the ``Engine`` interface of the roles (``scheduler_role.Engine``) -----------------------------
    def reject(self, rid: str, message: str, code: ErrorCode) -> None:
        self.out.error(rid, message, code)

    def send_now(self, outputs: list[Any]) -> None:
        self.out.send_now(outputs)

    def find_req(self, rid: str) -> Req | None:
        return self.reqs_by_rid.get(rid)

    def enqueue(self, reqs: list[Req]) -> None:
        self.waiting_queue.extend(reqs)

    def num_waiting(self) -> int:
        return len(self.waiting_queue) + len(self.preempted)

    def prefilling_reqs(self) -> list[Req]:
        return [*self.preempted, *self.waiting_queue, *([self.chunked_req] if self.chunked_req is not None else [])]

    def preempt_running(self, victims: list[Req], head: Req) -> None:
        batch_admission.preempt_running(self, victims, head)

    def running_reqs(self) -> list[Req]:
        return self.running_batch.reqs

    def build_req(self, msg: GenerateReqInput) -> Req | None:
        return self.intake.build_req(msg)

    def abort_request(self, rid: str, reason: str) -> None:
        """Waiting requests leave at once; a request in a batch finishes as ABORT at its next result."""
        req = self.reqs_by_rid.get(rid)
        if req is None:
            return
        queue = self.preempted if req in self.preempted else self.waiting_queue
        if req in queue:
            queue.remove(req)
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
        batch_admission.add_prebuilt(self, reqs, take_first_token)

    # -- load (``common.engine.scheduler_metrics``) ----------------------------------------------------------------
    def get_load(self) -> QueueLoad:
        return scheduler_metrics.get_load(self)

def _reads_output_history(req: Req) -> bool:
    """Its next draw reads every output token so far (penalties, a grammar's matcher), not only the last one."""
    sp = req.sampling_params
    return sp.has_penalty or bool(sp.min_new_tokens) or req.grammar is not None


__all__ = ["Scheduler"]
