"""Decode attention over a padded page table, tensor ops only: what ``torch.compile`` traces for a decode step.

The eager ``TorchAttentionBackend`` builds its gather plan from host lists and checks page alignment with a host
sync; neither can sit inside a compiled graph. Here the plan is one int64 tensor built before the call::

    page_table [B, num_pages]  page_table[i, p] = page of keys [p * page_size, (p + 1) * page_size) of request i
    seq_lens   [B]             keys 0 .. seq_len-1 are visible (the query sits at seq_len-1)

``num_pages`` covers the longest request of the batch; entries at or past a request's length are junk and are
replaced by the padding page 0 before the gather, then masked. Relies on the allocator's alignment (key ``j`` at
offset ``j % page_size`` of its page). The attention itself is the eager backend's single-query SDPA call (query
heads of one KV head folded into SDPA's query axis), over whole pages gathered in one ``index_select``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.engine.forward_batch import ForwardBatch


@dataclass
class PaddedDecodeMetadata:
    page_table: torch.Tensor  # int64 [B, num_pages]
    seq_lens: torch.Tensor  # int64 [B]


def padded_page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, num_pages: int,
                      page_size: int) -> torch.Tensor:
    """int64 [B, num_pages] page ids of each request's keys (the first slot of each page-aligned run, // page)."""
    first_slots = req_to_token.index_select(0, req_pool_indices)[:, ::page_size]
    if first_slots.shape[1] < num_pages:  # the table is narrower than the padded length: pad with page 0
        first_slots = torch.nn.functional.pad(first_slots, (0, num_pages - first_slots.shape[1]))
    return first_slots[:, :num_pages] // page_size


class PaddedDecodeBackend:
    """The ``TorchAttentionBackend`` interface for decode batches whose ``attn_metadata`` is a
    ``PaddedDecodeMetadata`` (set by the caller; there is no ``init_forward_metadata``)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 sliding_window: int | None = None) -> None:
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """q: [B, heads, head_dim]; k, v: [B, kv_heads, head_dim] of the new tokens. Writes k/v to the pool at
        ``fb.out_cache_loc``, then returns attention output [B, heads * head_dim]."""
        fb.kv_pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)
        md: PaddedDecodeMetadata = fb.attn_metadata
        bs, kv_heads, d, ps = q.shape[0], self.num_kv_heads, self.head_dim, self.page_size
        group = self.num_heads // kv_heads
        n = md.page_table.shape[1] * ps
        key_pos = torch.arange(n, device=q.device)
        seq = md.seq_lens[:, None]
        visible = key_pos[None, :] < seq  # [B, n]
        if self.sliding_window is not None:
            visible &= key_pos[None, :] >= seq - self.sliding_window
        # A page is read when it holds a key before seq_len (the window masks scores, not pages).
        pages = torch.where(key_pos[None, ::ps] < seq, md.page_table, 0).reshape(-1)
        k_pages = fb.kv_pool.get_key_buffer(layer_id).view(-1, ps * kv_heads * d)
        v_pages = fb.kv_pool.get_value_buffer(layer_id).view(-1, ps * kv_heads * d)
        keys = k_pages.index_select(0, pages).view(bs, n, kv_heads, d).transpose(1, 2).to(q.dtype)
        values = v_pages.index_select(0, pages).view(bs, n, kv_heads, d).transpose(1, 2).to(q.dtype)
        # NOTE: SDPA (an extern kernel for inductor) rather than written-out reductions: inductor would inline the
        # rotary embedding of q (cos/sin) into a reduction over keys and recompute it for every key.
        qg = q.reshape(bs, kv_heads, group, d)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible[:, None, None, :], scale=self.scale)
        return out.reshape(bs, -1)
