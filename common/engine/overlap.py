"""Future token ids: how the overlap schedule prepares step k+1 before step k's tokens exist.

The scheduler thread launches batch k on the forward thread and, while it runs, prepares batch k+1. A request in
batch k has not got its step-k token yet, so batch k+1 feeds it a placeholder: ``-(slot + 1)``, where ``slot`` is
the ring entry that batch k's sampler writes the token into. The forward thread runs batches one at a time in
launch order, so when batch k+1 resolves its placeholders (first thing in its forward), batch k has stored them::

    scheduler thread:  prepare k | launch k | results k-1 | prepare k+1 (placeholders of k) | launch k+1 | results k
    forward thread:                | forward k ... store k's tokens -> ring |  resolve k+1's inputs, forward k+1 ...

Invariants:
- Only rows that produce a real token (not a middle prefill chunk) get a slot; the others write into ``dump_slot``,
  which nothing reads. ``Req.future_slot`` is the slot of the request's newest launched token that has not been
  appended to ``output_ids`` yet.
- The ring holds ``RING_BATCHES`` batches of at most ``max_bs`` rows: a slot is reused only after the batch that
  reads it (the next one) has resolved it. Slot allocation is on the scheduler thread; the ring tensor is touched
  only by the forward thread.
"""

from __future__ import annotations

import torch

from common.config import ServerArgs
from common.engine.device import cpu_threads_per_rank, usable_cores

RING_BATCHES = 4  # launched (k), being prepared (k+1), and slack: the reader of a slot is always the next batch


def overlap_schedule_on(args: ServerArgs, device: torch.device) -> bool:
    """Whether a rank overlaps its forward with scheduling: on unless ``--disable-overlap-schedule``, except on CPU
    where the node's torch threads take every core (there the scheduler thread would take a core from the forward's
    threads, which then wait on each other: measured slower) unless ``--enable-overlap-schedule``.

    Speculative decoding: a colocated or decode node runs without it (a step's drafts need the previous step's
    accepted tokens; ``--enable-overlap-schedule`` with it is refused). A prefill node verifies nothing: the draft's
    prefill-side work (STANDALONE's extend over each chunk, EAGLE's head extend and its handoff state) is the target
    forward's spec hook, which runs on the forward thread right after that forward, in launch order, so it overlaps
    as any prefill node does."""
    if args.disable_overlap_schedule or (args.speculative_algorithm is not None
                                         and args.disaggregation_mode != "prefill"):
        return False
    if args.enable_overlap_schedule or device.type != "cpu":
        return True
    return cpu_threads_per_rank(args) * args.dp_size * len(args.tp_ranks_here) < usable_cores()


class FutureTokenMap:
    def __init__(self, max_bs: int, device: torch.device) -> None:
        self.size = RING_BATCHES * max_bs
        self.max_bs = max_bs
        self.dump_slot = self.size
        self.token_ids = torch.zeros(self.size + 1, dtype=torch.int64, device=device)
        self._cursor = 0  # scheduler thread only

    def alloc(self, n: int) -> list[int]:
        """``n`` consecutive (mod size) slots for one batch's rows."""
        if n > self.max_bs:
            raise ValueError(f"a batch of {n} rows exceeds the future-token ring's {self.max_bs} rows per batch")
        start, self._cursor = self._cursor, (self._cursor + n) % self.size
        return [(start + i) % self.size for i in range(n)]

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Replace placeholders (``Req.next_input_id``) by the tokens stored in their slots (forward thread, device tensors)."""
        slots = (-input_ids - 1).clamp_(min=0)
        return torch.where(input_ids < 0, self.token_ids[slots], input_ids)

    def store(self, slots: torch.Tensor, next_token_ids: torch.Tensor) -> None:
        """``slots``: int64 [bs] on the device, ``dump_slot`` for rows whose token is not real (forward thread)."""
        self.token_ids.index_copy_(0, slots, next_token_ids)
