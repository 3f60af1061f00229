"""``ModelWorker``: the scheduler's side of the model runner (SGLang's ``TpModelWorker`` and, for the overlap
schedule, ``TpModelWorkerClient``). It turns a ``ScheduleBatch`` into the ``ModelWorkerBatch`` the runner needs and
runs it at once (``run``), or launches it on the forward thread (``launch``) and holds it in flight until the next
step obtains its result (``take_in_flight`` -> ``result``).

KV pages and the batch in flight (the hazard: ``common.engine.mem.allocator``, deferred frees):
- Pages freed while ``process_batch_result`` runs with a batch in flight (finished and failed requests) become
  allocatable only once that batch's result is obtained (``result``). That batch may still write a finished
  request's next KV slot into them, and a writer in another process (a prefill node filling pages a decode node
  preallocated: CUDA IPC, RDMA) is not ordered after it on this rank's device stream.
- Deferred pages exist only from that processing until the next step obtains the in-flight batch's result, so only
  while ``in_flight`` is set: the pools' free counts are whole whenever the scheduler is idle.
- Short of KV for the next decode step, the scheduler first obtains the awaited batch's result
  (``reclaim_deferred_pages``: one step without overlap) rather than retract for pages merely deferred.
- The step's other frees (aborts and transfer failures in the role's hooks; retraction and radix evictions while the
  next batch is chosen) stay immediate: this rank's own next batch is ordered after the in-flight one on the device
  stream, and pages reach another process's writer only through ``role.poll`` (a decode node's preallocation),
  which runs after the step that obtains the in-flight result. A decode node's prefix cache (``HeldPrefixCache``)
  holds only landed or computed prompt pages, so no page it frees can hold a slot an in-flight batch writes.
- Every role defers alike (it costs a list append). Only a decode node needs it: a prefill node's pages are read,
  not written, by other processes, and only while it keeps them (until the transfer ends); its own next forward
  reusing a freed page is ordered after the in-flight one.
- Request slots (``req_to_token`` rows) are freed at once: no other process writes them, and a new owner's row
  reaches the device with a later batch, after the in-flight one.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import torch

from common.engine.sampling.sampler import SamplingBatchInfo
from common.faults import inject

if TYPE_CHECKING:
    from common.engine.model_runner import BatchResult, ModelRunner, PendingBatchResult
    from common.engine.schedule_batch import ModelWorkerBatch, ScheduleBatch


class InFlight(NamedTuple):
    batch: ScheduleBatch  # what processing its results needs, frozen at launch (``ScheduleBatch.copy``)
    future: Future[PendingBatchResult]


class ModelWorker:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.allocator = runner.allocator
        self.vocab_size = runner.model_config.vocab_size
        self.forward_thread: ThreadPoolExecutor | None = None  # created by the first launch
        self.in_flight: InFlight | None = None  # launched, results unprocessed
        self.awaited: Future[PendingBatchResult] | None = None  # within an overlapped step: the last step's launch

    def worker_batch(self, batch: ScheduleBatch) -> ModelWorkerBatch:
        """What the runner needs, read from the requests now (the forward may run while they change)."""
        for req in batch.reqs:
            inject("forward", req.rid)
        b = batch.get_model_worker_batch()
        rows = batch.reqs if batch.spec_info is None else batch.spec_info.sampling_rows(batch.reqs)  # one per token
        b.sampling_info = SamplingBatchInfo.from_reqs(rows, self.vocab_size, self.runner.device)
        return b

    def run(self, batch: ScheduleBatch) -> BatchResult:
        """Forward and sample ``batch`` on this thread."""
        return self.runner.forward_and_sample(self.worker_batch(batch))

    def launch(self, batch: ScheduleBatch) -> Future[PendingBatchResult]:
        """Start ``batch`` on the forward thread; it is in flight until the next step takes it. Each row that yields
        a real token (all but a middle prefill chunk) gets a ring slot: the next batch feeds the request that slot's
        placeholder (``common.engine.overlap``)."""
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
        self.in_flight = InFlight(batch.copy(), self.forward_thread.submit(self.runner.launch, b))
        return self.in_flight.future

    def take_in_flight(self) -> InFlight | None:
        """Start of an overlapped step: the batch the last step launched, awaited until ``end_step``."""
        prev, self.in_flight = self.in_flight, None
        self.awaited = None if prev is None else prev.future
        return prev

    def end_step(self) -> None:
        self.awaited = None

    def result(self, future: Future[PendingBatchResult]) -> BatchResult:
        """A launched batch's result; the pages freed while it was in flight become allocatable.

        NOTE: ``PendingBatchResult.wait`` returns once the sampled tokens, copied to the host on the forward's
        stream after all of the batch's kernels, have landed (the step's one sync): its KV writes have completed.
        """
        result = future.result().wait()
        self.allocator.release_deferred()
        return result

    def reclaim_deferred_pages(self) -> bool:
        """Under KV pressure (before retracting): wait for the batch launched by the last step, which makes the
        pages deferred while it was in flight allocatable. Whether any were."""
        if self.awaited is None or self.allocator.num_deferred_pages == 0:
            return False
        self.result(self.awaited)
        return True

    def last_launched(self) -> Future[PendingBatchResult] | None:
        """The batch launched last, while it may still write KV (a hierarchical cache's copies wait for it)."""
        return self.in_flight.future if self.in_flight is not None else self.awaited

    def close(self) -> None:
        """Stop the forward thread (after its batch)."""
        if self.forward_thread is not None:
            self.forward_thread.shutdown(wait=True)
            self.forward_thread = None
