"""Paged allocator of KV token slots over ``MHATokenToKVPool``.

The unit of ownership is a page; callers see token slots (``slot = page * page_size + offset``)::

    pages:  [ 0 (padding, never allocated) | 1 | 2 | ... | num_pages ]
    state:  _is_free[page] is True  <=>  page is in _free_pages, one of _released or one of _deferred (exactly once)
    allocatable (counted by num_free_pages): _free_pages and _released; _deferred pages are neither

Deferred frees (``defer_frees``/``release_deferred``): under the overlap schedule a batch is still running on the
device when the previous batch's results free pages, and it may still write a finished request's next KV slot
into them. Another batch of this rank is ordered after it on the device stream, but a writer in another process
(a prefill node writing KV one-sided into pages a decode node preallocated: CUDA IPC, RDMA) is not. So pages freed
while a batch is in flight stay out of the free list until the scheduler has seen that batch complete.

Invariants the callers (radix cache, scheduler) keep, which make page ownership exclusive:
- Position alignment: a request's token at position ``i`` lives at a slot with ``slot % page_size == i % page_size``
  (``alloc_extend``/``alloc_decode`` preserve it; fresh pages start at a page-aligned position).
- The prefix cache only holds whole pages, and a request's last, partially filled page belongs to that request
  alone. So freeing any slot of a page frees the whole page, and each page is freed exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

IntsLike = Sequence[int] | torch.Tensor


class TokenToKVPoolAllocator:
    """Hands out KV slots in whole pages. Single-threaded (the scheduler's)."""

    def __init__(self, num_pages: int, page_size: int, device: str | torch.device = "cpu", first_page: int = 1
                 ) -> None:
        """Pages ``first_page .. first_page + num_pages - 1`` (the pages below belong to someone else: page 0 the
        padding page; a STANDALONE draft's pages mirroring the target's)."""
        if num_pages <= 0 or page_size <= 0 or first_page < 1:
            raise ValueError(f"allocator needs num_pages > 0, page_size > 0 and first_page >= 1, got {num_pages}, "
                             f"{page_size}, {first_page}")
        self.num_pages = num_pages
        self.first_page = first_page
        self.page_size = page_size
        self.device = torch.device(device)
        self._free_pages = torch.empty(0, dtype=torch.int64, device=self.device)
        # Freed pages are queued here and appended to _free_pages lazily, when an alloc needs them: freeing
        # never copies the (large) free stack.
        self._released: list[torch.Tensor] = []
        self._num_released = 0
        self._deferring = False
        self._deferred: list[torch.Tensor] = []
        self._num_deferred = 0
        self._is_free = torch.ones(first_page + num_pages, dtype=torch.bool, device=self.device)
        self.clear()

    # -- sizes -----------------------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Allocatable token slots in total (the padding page excluded)."""
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages) + self._num_released

    def available_size(self) -> int:
        """Free token slots: free pages x page_size."""
        return self.num_free_pages * self.page_size

    @property
    def num_deferred_pages(self) -> int:
        """Freed pages not allocatable yet (``defer_frees``)."""
        return self._num_deferred

    # -- allocation ------------------------------------------------------------------------------------------------
    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """The first ``num_tokens`` slots of ``ceil(num_tokens / page_size)`` fresh pages, or ``None``.

        The unused slots of the last page are owned along with it (freed when any slot of that page is freed).
        """
        pages = self._take(-(-num_tokens // self.page_size))
        if pages is None:
            return None
        if self.page_size == 1:
            return pages
        return self._page_slots(pages)[:num_tokens]

    def alloc_extend(
        self, prefix_lens: IntsLike, seq_lens: IntsLike, last_locs: IntsLike
    ) -> torch.Tensor | None:
        """New slots for positions ``[prefix_lens[i], seq_lens[i])`` of each request, concatenated in order.

        ``last_locs[i]`` is the slot of position ``prefix_lens[i] - 1``; it is read only when ``prefix_lens[i]`` is
        not page-aligned, and then the rest of its page is used first. Returns ``None`` (nothing allocated) when
        there are not enough free pages.
        """
        ps = self.page_size
        prefix = self._as_tensor(prefix_lens)
        ext = self._as_tensor(seq_lens) - prefix
        if ps == 1:
            return self._take(int(ext.sum()))
        last = self._as_tensor(last_locs)
        in_page = prefix % ps
        # head: slots taken from the request's current partial page; rest: slots on fresh pages.
        head = torch.where(in_page != 0, torch.minimum(ps - in_page, ext), torch.zeros_like(ext))
        num_new_pages = (ext - head + ps - 1) // ps
        pages = self._take(int(num_new_pages.sum()))
        if pages is None:
            return None
        req = torch.repeat_interleave(torch.arange(len(ext), device=self.device), ext)
        # k: index of each new token among its request's new tokens.
        k = torch.arange(len(req), device=self.device) - (torch.cumsum(ext, 0) - ext)[req]
        out = torch.empty_like(k)
        on_head = k < head[req]
        out[on_head] = last[req[on_head]] + 1 + k[on_head]
        req_f = req[~on_head]
        q = k[~on_head] - head[req_f]  # index among the request's slots on fresh pages
        page_start = torch.cumsum(num_new_pages, 0) - num_new_pages
        out[~on_head] = pages[page_start[req_f] + q // ps] * ps + q % ps
        return out

    def alloc_decode(self, seq_lens: IntsLike, last_locs: IntsLike) -> torch.Tensor | None:
        """One slot per request for position ``seq_lens[i] - 1`` (lengths after adding the new token).

        A fresh page is taken only when that position starts a page; otherwise the slot is ``last_locs[i] + 1``.
        """
        ps = self.page_size
        if ps == 1:
            return self._take(len(seq_lens))
        # NOTE: numpy: every decode step runs this for the whole batch, and a numpy op on a batch-sized array
        # costs a fraction of a torch op's dispatch. The allocator lives on the host (no copies then).
        starts = (np.asarray(seq_lens, dtype=np.int64) - 1) % ps == 0
        pages = self._take(int(starts.sum()))
        if pages is None:
            return None
        locs = np.asarray(last_locs, dtype=np.int64) + 1
        locs[starts] = pages.cpu().numpy() * ps
        return torch.from_numpy(locs).to(self.device)

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages that hold ``slots`` (each page once, however many of its slots are given).

        Freeing a page that is not allocated (already free, or the padding page 0) raises ``RuntimeError`` and
        frees nothing.
        """
        if slots.numel() == 0:
            return
        pages = torch.unique(slots.to(self.device, torch.int64) // self.page_size)
        bad = self._is_free[pages]
        if bool(bad.any()):
            raise RuntimeError(
                f"TokenToKVPoolAllocator.free: pages not allocated (double free?): {pages[bad].tolist()}"
            )
        self._is_free[pages] = True
        if self._deferring:
            self._deferred.append(pages)
            self._num_deferred += len(pages)
        else:
            self._released.append(pages)
            self._num_released += len(pages)

    # -- deferred frees --------------------------------------------------------------------------------------------
    @contextmanager
    def defer_frees(self) -> Iterator[None]:
        """Pages freed inside the block are held back (not allocatable, not counted free) until ``release_deferred``.

        The caller must call ``release_deferred`` once the work that may still write those pages has completed.
        """
        if self._deferring:
            raise RuntimeError("TokenToKVPoolAllocator.defer_frees is not reentrant")
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def release_deferred(self) -> None:
        """Every held-back page becomes allocatable."""
        if self._deferred:
            self._released.extend(self._deferred)
            self._num_released += self._num_deferred
            self._deferred, self._num_deferred = [], 0

    # -- state -----------------------------------------------------------------------------------------------------
    def backup_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._merge()
        deferred = torch.cat([torch.empty(0, dtype=torch.int64, device=self.device), *self._deferred])
        return self._free_pages.clone(), self._is_free.clone(), deferred

    def restore_state(self, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self._free_pages, is_free, deferred = state
        self._is_free = is_free.clone()
        self._released, self._num_released = [], 0
        self._deferred, self._num_deferred = ([deferred.clone()] if len(deferred) else []), len(deferred)

    def clear(self) -> None:
        """Every page free again, handed out lowest id first."""
        self._free_pages = torch.arange(self.first_page, self.first_page + self.num_pages, dtype=torch.int64,
                                        device=self.device)
        self._released, self._num_released = [], 0
        self._deferred, self._num_deferred = [], 0
        # NOTE: the pages below first_page (the padding page 0) also read as free, so that freeing one is refused like
        # a double free.
        self._is_free.fill_(True)

    # -- internals -------------------------------------------------------------------------------------------------
    def _as_tensor(self, x: IntsLike) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.int64, device=self.device)

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def _merge(self) -> None:
        if self._released:
            # NOTE: no global sort (O(n log n) on every merge); each released batch is sorted (torch.unique),
            # so a request's pages come back as ascending runs, which keeps KV transfers coalescable.
            self._free_pages = torch.cat([self._free_pages, *self._released])
            self._released, self._num_released = [], 0

    def _take(self, n: int) -> torch.Tensor | None:
        if n > self.num_free_pages:
            return None
        if n > len(self._free_pages):
            self._merge()
        out, self._free_pages = self._free_pages[:n], self._free_pages[n:]
        self._is_free[out] = False
        return out
