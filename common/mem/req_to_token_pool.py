"""Request slots: each running request owns one row of ``req_to_token``.

Row layout (``kv_committed_len`` is the request's ``Req.kv_committed_len``)::

    req_to_token[req_pool_idx]:
    | KV slot of token 0 | token 1 | ... | token kv_committed_len-1 | (stale, unused) ... | max_context_len
    |<-- prefix from the radix cache -->|<-- slots the request owns -->|

Invariant: a row index is either in the free stack or owned by exactly one request, never both.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Maps a request slot to the KV token slots of its sequence."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(
                f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size}, {max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=self.device)
        self._free_slots: list[int] = []
        self._is_free: list[bool] = []
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

    def write(self, req_pool_idx: int, start: int, slots: torch.Tensor) -> None:
        """Store ``slots`` as the KV slots of positions ``[start, start + len(slots))`` of row ``req_pool_idx``."""
        self.req_to_token[req_pool_idx, start : start + len(slots)] = slots

    def clear(self) -> None:
        self._free_slots = list(range(self.size - 1, -1, -1))
        self._is_free = [True] * self.size
