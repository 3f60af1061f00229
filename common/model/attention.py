"""Vectorized torch attention over the paged KV pool (the CPU path).

Requests of one forward are split into at most two groups, each attended by one padded SDPA call per layer
(no Python loop over requests):

    single-query group: extend_len == 1 (decode requests, and 1-token extends). The query heads sharing a KV head
                        are folded into SDPA's query axis: q [B, kv_heads, group, head_dim], mask [B, 1, 1, Lk].
    multi-query group:  extend_len > 1 (prefill chunks). q [B, heads, Lq_max, head_dim], causal mask that starts at
                        each request's prefix_len, mask [B, 1, Lq_max, Lk].

Splitting keeps a MIXED batch (one long chunk + many decodes) from padding every decode to the chunk's length.

KV of a group is gathered from the pool through ``req_to_token``::

    req_to_token[req_pool_indices[i], 0 : seq_lens[i]]  -> slots of request i's keys 0 .. seq_len-1
    padded columns (key_pos >= seq_len) read slot 0 (padding page) and are masked out.

When every slot of the group sits at offset ``key_pos % page_size`` of its page (the paged allocator's layout),
whole pages are gathered (one row of page_size * kv_heads * head_dim per page) instead of single slots.
Everything index-like is computed once per forward in ``init_forward_metadata``; layers only gather and attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.forward_batch import ForwardBatch


@dataclass
class _Group:
    rows: torch.Tensor | None  # int64 [B * Lq] packed-token row of each padded query; None: q as is
    out_sel: torch.Tensor | None  # int64 [n] valid padded queries, in packed order; None: all of them
    out_rows: torch.Tensor | None  # int64 [n] packed-token rows they are written to; None: the whole output
    kv_index: torch.Tensor  # int64 [B * Lk / unit] rows of the pool viewed as [num_slots / unit, unit * ...]
    unit: int  # slots per gathered row: page_size when page-aligned, else 1
    batch: int
    q_len: int  # Lq (1 for the single-query group)
    kv_len: int  # Lk, a multiple of unit
    mask: torch.Tensor  # bool [B, 1, Lq, Lk], True = attend


@dataclass
class TorchAttnMetadata:
    groups: list[_Group]


class TorchAttentionBackend:
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None
    ) -> None:
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build the per-forward gather indices and masks into ``fb.attn_metadata`` (once, before layer 0)."""
        ext = fb.extend_lens_cpu
        single = [i for i, n in enumerate(ext) if n == 1]
        multi = [i for i, n in enumerate(ext) if n > 1]
        starts: list[int] = []
        total = 0
        for n in ext:
            starts.append(total)
            total += n
        groups = []
        if single:
            groups.append(self._single_query_group(fb, single, starts, whole=len(single) == len(ext)))
        if multi:
            groups.append(self._multi_query_group(fb, multi, starts, whole=len(multi) == len(ext)))
        fb.attn_metadata = TorchAttnMetadata(groups)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] of the new tokens. Writes k/v to the pool at
        ``fb.out_cache_loc``, then returns attention output [T, heads * head_dim]."""
        fb.kv_pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)
        k_buf = fb.kv_pool.get_key_buffer(layer_id)
        v_buf = fb.kv_pool.get_value_buffer(layer_id)
        groups = fb.attn_metadata.groups
        t = q.shape[0]
        if len(groups) == 1 and groups[0].out_rows is None:
            return self._attend(groups[0], q, k_buf, v_buf).reshape(t, -1)
        out = q.new_empty(t, self.num_heads * self.head_dim)
        for g in groups:  # at most two groups
            out[g.out_rows] = self._attend(g, q, k_buf, v_buf)
        return out

    def _attend(self, g: _Group, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
        """Returns [n, heads * head_dim] for the group's valid queries, in packed order."""
        kv_heads, d = self.num_kv_heads, self.head_dim
        k = _gather(k_buf, g).view(g.batch, g.kv_len, kv_heads, d).transpose(1, 2).to(q.dtype)
        v = _gather(v_buf, g).view(g.batch, g.kv_len, kv_heads, d).transpose(1, 2).to(q.dtype)
        qg = q if g.rows is None else q.index_select(0, g.rows)
        if g.q_len == 1:
            qg = qg.view(g.batch, kv_heads, self.num_heads // kv_heads, d)
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=self.scale)
            return out.reshape(g.batch, -1)
        qg = qg.view(g.batch, g.q_len, self.num_heads, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=self.scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(g.batch * g.q_len, -1)
        return out if g.out_sel is None else out.index_select(0, g.out_sel)

    def _single_query_group(self, fb: ForwardBatch, idx: list[int], starts: list[int], whole: bool) -> _Group:
        device = fb.input_ids.device
        seq_lens = [fb.seq_lens_cpu[i] for i in idx]
        rows = None if whole else _i64([starts[i] for i in idx], device)
        q_pos = _i64(seq_lens, device)[:, None] - 1  # [B, 1]
        return self._group(fb, idx, seq_lens, q_pos, rows, None, rows)

    def _multi_query_group(self, fb: ForwardBatch, idx: list[int], starts: list[int], whole: bool) -> _Group:
        device = fb.input_ids.device
        ext = [fb.extend_lens_cpu[i] for i in idx]
        q_len = max(ext)
        j = torch.arange(q_len, device=device)[None, :]
        ext_t = _i64(ext, device)[:, None]
        start_t = _i64([starts[i] for i in idx], device)[:, None]
        prefix_t = _i64([fb.prefix_lens_cpu[i] for i in idx], device)[:, None]
        # NOTE: padded queries (j >= extend_len) repeat the request's last token so every row has a visible key.
        jj = torch.minimum(j, ext_t - 1)
        rows = (start_t + jj).reshape(-1)
        q_pos = prefix_t + jj  # [B, Lq]
        sel = (torch.arange(len(idx), device=device)[:, None] * q_len + j)[j < ext_t]
        out_rows = None if whole else rows.index_select(0, sel)
        out_sel = None if sel.numel() == rows.numel() else sel
        return self._group(fb, idx, [fb.seq_lens_cpu[i] for i in idx], q_pos, rows, out_sel, out_rows)

    def _group(
        self,
        fb: ForwardBatch,
        idx: list[int],
        seq_lens: list[int],
        q_pos: torch.Tensor,
        rows: torch.Tensor | None,
        out_sel: torch.Tensor | None,
        out_rows: torch.Tensor | None,
    ) -> _Group:
        device = fb.input_ids.device
        page = fb.kv_pool.page_size
        kv_len = -(-max(seq_lens) // page) * page
        b = len(idx)
        if b == len(fb.extend_lens_cpu):
            rpi = fb.req_pool_indices
        else:
            rpi = fb.req_pool_indices.index_select(0, _i64(idx, device))
        width = min(kv_len, fb.req_to_token.shape[1])
        slots = fb.req_to_token[:, :width].index_select(0, rpi)
        if width < kv_len:
            slots = F.pad(slots, (0, kv_len - width))
        kv_pos = torch.arange(kv_len, device=device)
        in_seq = kv_pos[None, :] < _i64(seq_lens, device)[:, None]
        slots = torch.where(in_seq, slots, 0)
        # [B, Lq, Lk]; every q_pos < seq_len, so causality implies in_seq.
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]
        if self.sliding_window is not None:
            mask &= kv_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
        unit, kv_index = 1, slots.reshape(-1)
        if page > 1:
            first = slots[:, ::page]  # [B, Lk / page]
            pages = first // page
            expect = (pages * page).repeat_interleave(page, dim=1) + kv_pos % page
            if bool(((expect == slots) | ~in_seq).all()):
                unit, kv_index = page, torch.where(in_seq[:, ::page], pages, 0).reshape(-1)
        return _Group(
            rows=rows,
            out_sel=out_sel,
            out_rows=out_rows,
            kv_index=kv_index,
            unit=unit,
            batch=b,
            q_len=q_pos.shape[1],
            kv_len=kv_len,
            mask=mask[:, None],
        )


def _gather(buf: torch.Tensor, g: _Group) -> torch.Tensor:
    """Rows of the pool for the group's keys: [B * Lk, kv_heads * head_dim] (contiguous copy)."""
    num_slots = buf.shape[0]
    return buf.view(num_slots // g.unit, -1).index_select(0, g.kv_index)


def _i64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
