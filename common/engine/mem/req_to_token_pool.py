"""Request slots: each running request owns one row of ``req_to_token``.

Row layout (``kv_committed_len`` is the request's ``Req.kv_committed_len``)::

    req_to_token[req_pool_idx]:
    | KV slot of token 0 | token 1 | ... | token kv_committed_len-1 | (stale, unused) ... | max_context_len
    |<-- prefix from the radix cache -->|<-- slots the request owns -->|

    req_to_token[padding_row] (== size, one row past the allocatable ones): all 0, the padding page's slot 0.

Invariant: a row index in [0, size) is either in the free stack or owned by exactly one request, never both. The
padding row is never handed out or written: padded rows of a compiled decode batch (``common.engine.graph_runner``) point
at it, so their one key is the padding slot, which no request owns.

Two copies of the table: ``req_to_token`` on the host is the authoritative one, read and written by the scheduler
(batch preparation, prefix cache, KV transfer page lists); ``device_req_to_token`` on the model's device is what
attention reads. Every write goes through ``write``/``write_points``, which log the flat positions written; the
model runner ships the logged entries with the step's inputs (``take_updates``) and scatters them into the mirror
before the forward. On CPU the mirror IS the host table and nothing is logged.

NOTE: with the overlap schedule (prefill nodes) the forward thread takes the updates while the scheduler thread may
write; the log is swapped under a lock, so each write is shipped by exactly one step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch


class ReqToTokenPool:
    """Maps a request slot to the KV token slots of its sequence."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        """``device``: where the mirror lives (the model's device); the authoritative table is on the host."""
        if size <= 0 or max_context_len <= 0:
            raise ValueError(
                f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size}, {max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.padding_row = size
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int64)
        self.mirrored = self.device.type != "cpu"
        self.device_req_to_token = (
            torch.zeros((size + 1, max_context_len), dtype=torch.int64, device=self.device)
            if self.mirrored else self.req_to_token
        )
        self._flat = self.req_to_token.view(-1)
        self._dirty: list[torch.Tensor] = []  # host int64 flat positions written since the last take_updates
        self._dirty_lock = threading.Lock()
        self._free_slots: list[int] = []
        self._is_free: list[bool] = []
        # Told of every freed row, after it is free (a speculative draft model frees its KV of the row).
        self.on_free: Callable[[list[int]], None] | None = None
        self.clear()

    def available_size(self) -> int:
        return len(self._free_slots)

    def alloc(self, n: int = 1) -> list[int] | None:
        """Take ``n`` free rows (lowest ids first after a clear); ``None`` and nothing taken if too few are free."""
        if n > len(self._free_slots):
            return None
        # NOTE: the stack is kept in descending order after clear(), so pop() yields 0, 1, 2, ...
        out = [self._free_slots.pop() for _ in range(n)]
        for i in out:
            self._is_free[i] = False
        return out

    def free(self, idx: int | list[int]) -> None:
        """Return rows to the pool. Freeing a row that is not allocated raises ``RuntimeError`` (nothing freed)."""
        indices = [idx] if isinstance(idx, int) else list(idx)
        if len(set(indices)) != len(indices):
            raise RuntimeError(f"ReqToTokenPool.free: duplicate request slots in {indices}")
        for i in indices:
            if not 0 <= i < self.size or self._is_free[i]:
                raise RuntimeError(f"ReqToTokenPool.free: request slot {i} is not allocated (double free?)")
        for i in indices:
            self._is_free[i] = True
            self._free_slots.append(i)
        if self.on_free is not None:
            self.on_free(indices)

    def write(self, req_pool_idx: int, start: int, slots: torch.Tensor | list[int]) -> None:
        """Store ``slots`` as the KV slots of positions ``[start, start + len(slots))`` of row ``req_pool_idx``."""
        end = start + len(slots)
        self.req_to_token[req_pool_idx, start:end] = torch.as_tensor(slots, dtype=torch.int64)
        if self.mirrored and end > start:
            base = req_pool_idx * self.max_context_len
            with self._dirty_lock:
                self._dirty.append(torch.arange(base + start, base + end, dtype=torch.int64))

    def write_points(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """``req_to_token[rows[i], cols[i]] = slots[i]`` for every i (one new token per request)."""
        flat = torch.from_numpy(np.asarray(rows, dtype=np.int64) * self.max_context_len
                                + np.asarray(cols, dtype=np.int64))
        self._flat[flat] = slots
        if self.mirrored:
            with self._dirty_lock:
                self._dirty.append(flat)

    def take_updates(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Flat positions written since the last call and their current host values (``None``: nothing to ship).

        Values are read now, not at write time, so a position written twice carries its last value in every
        duplicate and the device scatter is order-independent.
        """
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, []
        if not dirty:
            return None
        flat = dirty[0] if len(dirty) == 1 else torch.cat(dirty)
        return flat, self._flat[flat]

    def clear(self) -> None:
        """Every row free again (row contents are left as they are: a row is rewritten before it is read)."""
        self._free_slots = list(range(self.size - 1, -1, -1))
        self._is_free = [True] * self.size
