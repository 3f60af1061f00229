"""Per-layer K and V buffers of the paged KV cache.

Slot layout of every layer's buffer (``page_size`` slots per page; page 0 is a padding page, never allocated)::

    k_buffer[layer]: [ page 0 (pad) | page 1 | page 2 | ... | page num_pages ]   each page: page_size slots
    one slot:        [num_kv_heads, head_dim]

A token's KV slot index is ``page * page_size + offset``. Each buffer is one contiguous tensor, so a page of one
layer is ``item_len = page_size * num_kv_heads * head_dim * itemsize`` contiguous bytes (what KV transfer moves).
"""

from __future__ import annotations

import torch


class MHATokenToKVPool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_layers = num_layers
        self.device = torch.device(device)
        num_slots = (num_pages + 1) * page_size
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def size(self) -> int:
        """Allocatable token slots (the padding page excluded)."""
        return self.num_pages * self.page_size

    @property
    def item_len(self) -> int:
        """Bytes of one page of one layer's K (or V) buffer."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.k_buffer[0].element_size()

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([n, num_kv_heads, head_dim]) into slots ``loc`` ([n])."""
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
