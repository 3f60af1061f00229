"""Verify (tree) attention over a padded page table, tensor ops only: what ``torch.compile`` traces for a
``TARGET_VERIFY`` step of ``B`` requests x ``N`` rows (``common.engine.verify_graph_runner``)::

    q rows       [B * N]          request i's rows i * N .. i * N + N - 1
    prefix_lens  [B]              C_i: keys 0 .. C_i - 1 are the committed prefix, visible to every row of i
    mask         [B, N, N] bool   row j of request i sees new key k (position C_i + k in ``req_to_token``) iff
                                  mask[i, j, k]; each row sees at least itself
    positions    [B * N]          each row's position (the sliding window over the prefix is measured from it)
    page_table   [B, num_pages]   pages of keys [0, C_i + N) (``padded_page_table``); past that: page 0

The new rows' K/V are written to the pool first, so new keys are read from the pool like the prefix. Relies on the
allocator's page alignment, as ``PaddedDecodeBackend`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.engine.forward_batch import ForwardBatch
from common.engine.model.padded_decode_backend import PaddedDecodeBackend


@dataclass
class PaddedVerifyMetadata:
    page_table: torch.Tensor  # int64 [B, num_pages]
    prefix_lens: torch.Tensor  # int64 [B]
    mask: torch.Tensor  # bool [B, N, N]


class PaddedVerifyBackend(PaddedDecodeBackend):
    """The ``TorchAttentionBackend`` interface for padded verify batches whose ``attn_metadata`` is a
    ``PaddedVerifyMetadata`` (set by the caller; there is no ``init_forward_metadata``); the head geometry as
    ``PaddedDecodeBackend``'s."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """q: [B * N, heads, head_dim]; k, v: [B * N, kv_heads, head_dim]. Writes k/v to the pool at
        ``fb.out_cache_loc``, then returns attention output [B * N, heads * head_dim]."""
        fb.kv_pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)
        md: PaddedVerifyMetadata = fb.attn_metadata
        bs, n_rows = md.mask.shape[0], md.mask.shape[1]
        kv_heads, d, ps = self.num_kv_heads, self.head_dim, self.page_size
        n = md.page_table.shape[1] * ps
        key_pos = torch.arange(n, device=q.device)
        prefix = md.prefix_lens[:, None]  # [B, 1]
        rel = key_pos[None, :] - prefix  # [B, n]: index of a key among the new rows
        is_new = (rel >= 0) & (rel < n_rows)
        seen = md.mask.gather(2, rel.clamp(0, n_rows - 1)[:, None, :].expand(bs, n_rows, n))  # [B, N, n]
        in_prefix = (key_pos[None, :] < prefix)[:, None, :].expand(bs, n_rows, n)
        if self.sliding_window is not None:
            q_pos = fb.positions.view(bs, n_rows, 1)
            in_prefix = in_prefix & (key_pos[None, None, :] > q_pos - self.sliding_window)
        visible = torch.where(is_new[:, None, :], seen, in_prefix)
        pages = torch.where(key_pos[None, ::ps] < prefix + n_rows, md.page_table, 0).reshape(-1)
        k_pages = fb.kv_pool.get_key_buffer(layer_id).view(-1, ps * kv_heads * d)
        v_pages = fb.kv_pool.get_value_buffer(layer_id).view(-1, ps * kv_heads * d)
        keys = k_pages.index_select(0, pages).view(bs, n, kv_heads, d).transpose(1, 2).to(q.dtype)
        values = v_pages.index_select(0, pages).view(bs, n, kv_heads, d).transpose(1, 2).to(q.dtype)
        qg = q.view(bs, n_rows, self.num_heads, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible[:, None], scale=self.scale,
                                             enable_gqa=True)
        return out.transpose(1, 2).reshape(bs * n_rows, -1)
