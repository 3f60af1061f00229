"""``ScheduleBatch``: the scheduler's view of one batch, and ``ModelWorkerBatch``, what the model runner needs.

A batch owns no memory itself; it moves slots between ``ReqToTokenPool``, the KV allocator and the prefix cache:

    prepare_for_extend:  req slot (new requests) + KV slots for positions [prefix_len, len(fill_ids))
    prepare_for_decode:  one KV slot per request for position seqlen - 1 (the last sampled token's KV)
    retract_decode:      frees a request's own slots (not the cache's), the request re-enters the queue
    cache_finished_req:  hands the request's slots to the prefix cache (or frees them) when it finishes

Everything here is host-side: the allocator's slots, ``out_cache_loc`` and the ``req_to_token`` table it reads and
writes are CPU tensors; the model runner ships them to the device once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.engine.forward_batch import ForwardMode
from common.engine.req import Req

if TYPE_CHECKING:
    from common.engine.mem.allocator import TokenToKVPoolAllocator
    from common.engine.mem.req_to_token_pool import ReqToTokenPool

RETRACT_DECODE_STEPS = 20  # decode steps a batch must be able to run after a retraction


@dataclass
class ModelWorkerBatch:
    forward_mode: ForwardMode
    input_ids: list[int]
    out_cache_loc: torch.Tensor  # host int64 [num_tokens]
    req_pool_indices: list[int]
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    reqs: list[Req]
    return_logprob: bool
    sampling_info: Any = None  # SamplingBatchInfo built on the scheduler thread (None: the runner builds it)
    future_slots: list[int] | None = None  # overlap: the ring slot each row's token is stored in
    has_placeholders: bool = False  # overlap: input_ids holds placeholders of tokens still being sampled
    spec_algorithm: str | None = None  # speculative decoding (--speculative-algorithm), None: off
    spec_info: Any = None  # a TARGET_VERIFY batch's VerifyInput (common.engine.spec.info)


class ScheduleBatch:
    def __init__(
        self,
        reqs: list[Req],
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree_cache: Any,
        spec_algorithm: str | None = None,
    ) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.forward_mode = ForwardMode.IDLE
        self.input_ids: list[int] = []
        self.out_cache_loc = torch.empty(0, dtype=torch.int64)
        self.seq_lens: list[int] = []
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.chunked_req: Req | None = None
        self.decoding_reqs: list[Req] = []  # the running requests folded into a MIXED batch
        self.future_slots: list[int] | None = None  # overlap: each row's ring slot, set when launched
        self.batch_is_full = False
        self.spec_algorithm = spec_algorithm  # --speculative-algorithm (None: off)
        self.spec_info: Any = None  # this step's VerifyInput when forward_mode is TARGET_VERIFY, else None

    @classmethod
    def init_new(cls, reqs: list[Req], req_to_token_pool: Any, allocator: Any, tree_cache: Any,
                 spec_algorithm: str | None = None) -> ScheduleBatch:
        return cls(reqs, req_to_token_pool, allocator, tree_cache, spec_algorithm)

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def return_logprob(self) -> bool:
        return any(r.return_logprob for r in self.reqs)

    # -- memory ----------------------------------------------------------------------------------------------------
    def _evict_for(self, num_tokens: int) -> None:
        if self.allocator.available_size() < num_tokens and self.tree_cache is not None:
            self.tree_cache.evict(num_tokens - self.allocator.available_size())

    def _alloc_req_slots(self, reqs: list[Req]) -> None:
        fresh = [r for r in reqs if r.req_pool_idx is None]
        if not fresh:
            return
        slots = self.req_to_token_pool.alloc(len(fresh))
        if slots is None:
            raise RuntimeError("out of request slots; the scheduler admitted more requests than max_running_requests")
        for req, slot in zip(fresh, slots, strict=True):
            req.req_pool_idx = slot

    def _last_locs(self, reqs: list[Req], lens: list[int]) -> list[int]:
        """KV slot of each request's token ``lens[i] - 1`` (-1 where ``lens[i] == 0``), from the host table."""
        if not reqs:
            return []
        table = self.req_to_token_pool.req_to_token.numpy()  # the host table itself (numpy: see alloc_decode)
        rows = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
        cols = np.asarray(lens, dtype=np.int64) - 1
        return np.where(cols >= 0, table[rows, np.maximum(cols, 0)], -1).tolist()

    # -- extend ----------------------------------------------------------------------------------------------------
    def prepare_for_extend(self) -> None:
        """Allocate slots for every request's new tokens and fill the flattened inputs."""
        self.forward_mode = ForwardMode.EXTEND
        reqs = self.reqs
        self._alloc_req_slots(reqs)
        prefix_lens = [len(r.prefix_indices) for r in reqs]
        seq_lens = [len(r.fill_ids) for r in reqs]
        pool = self.req_to_token_pool
        for req, plen in zip(reqs, prefix_lens, strict=True):
            if plen:
                pool.write(req.req_pool_idx, 0, req.prefix_indices)
        extend_num = sum(seq_lens) - sum(prefix_lens)
        self._evict_for(extend_num + len(reqs) * self.allocator.page_size)
        out = self.allocator.alloc_extend(prefix_lens, seq_lens, self._last_locs(reqs, prefix_lens))
        if out is None:
            raise RuntimeError(f"KV cache out of memory for {extend_num} prefill tokens; the adder's budget was wrong")
        offset = 0
        input_ids: list[int] = []
        for req, plen, slen in zip(reqs, prefix_lens, seq_lens, strict=True):
            n = slen - plen
            pool.write(req.req_pool_idx, plen, out[offset : offset + n])
            offset += n
            input_ids.extend(req.fill_ids[plen:slen])
            req.kv_committed_len = slen
            req.is_retracted = False
        self.input_ids = input_ids
        self.out_cache_loc = out
        self.prefix_lens = prefix_lens
        self.seq_lens = seq_lens
        self.extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens, strict=True)]

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Fold the running decode requests into this prefill batch (``ForwardMode.MIXED``, extend_len 1 each)."""
        running.prepare_for_decode()
        self.forward_mode = ForwardMode.MIXED
        self.decoding_reqs = list(running.reqs)
        self.reqs = self.reqs + running.reqs
        self.input_ids = self.input_ids + running.input_ids
        self.out_cache_loc = torch.cat([self.out_cache_loc, running.out_cache_loc])
        self.prefix_lens = self.prefix_lens + [s - 1 for s in running.seq_lens]
        self.seq_lens = self.seq_lens + running.seq_lens
        self.extend_lens = self.extend_lens + [1] * len(running.reqs)

    # -- decode ----------------------------------------------------------------------------------------------------
    def check_decode_mem(self) -> bool:
        """Whether one more decode step fits (each request may need a fresh page)."""
        need = len(self.reqs) * self.allocator.page_size
        if self.allocator.available_size() >= need:
            return True
        self._evict_for(need)
        return self.allocator.available_size() >= need

    def prepare_for_decode(self) -> None:
        self.forward_mode = ForwardMode.DECODE
        self.spec_info = None
        reqs = self.reqs
        self.input_ids = [r.next_input_id() for r in reqs]
        seq_lens = [r.kv_committed_len + 1 for r in reqs]
        self._evict_for(len(reqs) * self.allocator.page_size)
        out = self.allocator.alloc_decode(seq_lens, self._last_locs(reqs, [s - 1 for s in seq_lens]))
        if out is None:
            raise RuntimeError("KV cache out of memory in decode; check_decode_mem must run first")
        self.req_to_token_pool.write_points([r.req_pool_idx for r in reqs], [s - 1 for s in seq_lens], out)
        for req, slen in zip(reqs, seq_lens, strict=True):
            req.kv_committed_len = slen
        self.out_cache_loc = out
        self.seq_lens = seq_lens
        self.prefix_lens = [s - 1 for s in seq_lens]
        self.extend_lens = [1] * len(reqs)

    # -- speculative decoding (common.engine.spec.info: the verify's KV layout) -------------------------------------
    def check_verify_mem(self, extend_lens: list[int]) -> bool:
        """Whether each request can extend by ``extend_lens[i]`` tokens (its last one and its drafts)."""
        ps = self.allocator.page_size
        need = ps * sum(-(-(r.kv_committed_len + n) // ps) - -(-r.kv_committed_len // ps)
                        for r, n in zip(self.reqs, extend_lens, strict=True))
        self._evict_for(need)
        return self.allocator.available_size() >= need

    def prepare_for_verify(self, spec_info: Any) -> None:
        """A ``TARGET_VERIFY`` step: each request extends by its last token and its drafts (``check_verify_mem``
        first). ``trim_verified_kv`` gives back what the verify rejects."""
        self.forward_mode = ForwardMode.TARGET_VERIFY
        self.spec_info = spec_info
        reqs, ext = self.reqs, spec_info.extend_lens
        committed = [r.kv_committed_len for r in reqs]
        seq_lens = [c + n for c, n in zip(committed, ext, strict=True)]
        out = self.allocator.alloc_extend(committed, seq_lens, self._last_locs(reqs, committed))
        if out is None:
            raise RuntimeError("KV cache out of memory in a verify step; check_verify_mem must run first")
        input_ids: list[int] = []
        offsets: list[int] = []
        for req, drafts, c, s in zip(reqs, spec_info.drafts, committed, seq_lens, strict=True):
            offsets.append(len(input_ids))
            self.req_to_token_pool.write(req.req_pool_idx, c, out[len(input_ids) : len(input_ids) + s - c])
            input_ids.append(req.next_input_id())
            input_ids.extend(drafts)
            req.kv_committed_len = s
        spec_info.committed, spec_info.offsets = committed, offsets
        self.input_ids = input_ids
        self.out_cache_loc = out
        self.seq_lens = seq_lens
        self.prefix_lens = committed
        self.extend_lens = ext

    def trim_verified_kv(self, req: Req, keep: int) -> None:
        """After a verify: the request's KV is its first ``keep`` positions; the pages wholly past them are freed."""
        ps = self.allocator.page_size
        first_free = -(-keep // ps) * ps
        if first_free < req.kv_committed_len:
            self.allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, first_free:req.kv_committed_len])
        req.kv_committed_len = keep

    def retract_decode(self) -> tuple[list[Req], float]:
        """Free requests (fewest outputs, longest prompts first) until the rest can decode for a while.

        Returns the retracted requests (to re-enter the waiting queue and recompute) and the new_token_ratio
        estimate from what the remaining requests have decoded so far.
        """
        order = sorted(
            range(len(self.reqs)),
            key=lambda i: (len(self.reqs[i].output_ids), -len(self.reqs[i].origin_input_ids)),
            reverse=True,
        )
        retracted: list[Req] = []
        page = self.allocator.page_size

        def fits() -> bool:
            need = len(order) * max(RETRACT_DECODE_STEPS, page) + page
            return self.allocator.available_size() + self._evictable() >= need

        while len(order) > 1 and not fits():
            req = self.reqs[order.pop()]
            self.release_req_memory(req)
            req.reset_for_retract()
            retracted.append(req)
        self.filter_batch(keep=[self.reqs[i] for i in sorted(order)])
        decoded = sum(len(r.output_ids) for r in self.reqs)
        max_new = sum(r.sampling_params.max_new_tokens for r in self.reqs) or 1
        ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.reqs)) / max_new)
        return retracted, ratio

    def _evictable(self) -> int:
        return self.tree_cache.evictable_size() if self.tree_cache is not None else 0

    def release_req_memory(self, req: Req) -> None:
        """Give up a request's KV: its computed pages go to the prefix cache (evictable) or are freed, its slot too."""
        self.tree_cache.release_retracted(req)

    # -- composition -----------------------------------------------------------------------------------------------
    def filter_batch(self, keep: list[Req] | None = None, exclude: Req | None = None) -> None:
        """Keep ``keep`` (default: the unfinished requests, but for those whose in-flight token ends them), minus
        ``exclude`` (the chunked request)."""
        reqs = self.reqs if keep is None else keep
        self.reqs = [r for r in reqs if not r.finished() and not r.finishes_with_pending() and r is not exclude]

    def copy(self) -> ScheduleBatch:
        """What processing a launched batch's results needs, frozen while the scheduler prepares the next one."""
        batch = ScheduleBatch(list(self.reqs), self.req_to_token_pool, self.allocator, self.tree_cache,
                              self.spec_algorithm)
        batch.forward_mode = self.forward_mode
        batch.spec_info = self.spec_info
        batch.chunked_req = self.chunked_req
        batch.decoding_reqs = self.decoding_reqs
        batch.future_slots = self.future_slots
        return batch

    def merge_batch(self, other: ScheduleBatch) -> None:
        self.reqs = self.reqs + other.reqs

    def get_model_worker_batch(self) -> ModelWorkerBatch:
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],  # type: ignore[misc]
            seq_lens=self.seq_lens,
            prefix_lens=self.prefix_lens,
            extend_lens=self.extend_lens,
            reqs=self.reqs,
            return_logprob=self.return_logprob,
            future_slots=self.future_slots,
            spec_algorithm=self.spec_algorithm,
            spec_info=self.spec_info,
        )
