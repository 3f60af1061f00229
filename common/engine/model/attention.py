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

The single-query group is attended in chunks of requests (``_Group.chunks``, at most ``decode_chunk_bytes`` of
K+V each): per chunk the pages are copied by ``index_select(out=)`` into the backend's reusable scratch buffers and
SDPA reads them from cache, so no [B, Lk] K/V tensor is allocated per layer and the pool is read from memory once.
Rows of SDPA are independent, so chunking changes no result. The mask of that group is additive (0 / -inf, built
once per forward), so SDPA does not convert a bool mask in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.engine.forward_batch import ForwardBatch

DECODE_CHUNK_BYTES = 4 << 20  # K+V bytes gathered per SDPA call of the single-query group (stays in L3)
# NOTE: every chunk is a few parallel regions; on an oversubscribed CPU each can wait a time slice for a descheduled
# thread, so a group takes at most this many chunks (larger ones past DECODE_CHUNK_BYTES * MAX_DECODE_CHUNKS).
MAX_DECODE_CHUNKS = 4


@dataclass
class _Group:
    rows: torch.Tensor | None  # int64 [B * Lq] packed-token row of each padded query; None: q as is
    out_sel: torch.Tensor | None  # int64 [n] valid padded queries, in packed order; None: all of them
    out_rows: torch.Tensor | None  # int64 [n] packed-token rows they are written to; None: the whole output
    kv_index: torch.Tensor  # int64 [B, Lk / unit] rows of the pool viewed as [num_slots / unit, unit * ...]
    unit: int  # slots per gathered row: page_size when page-aligned, else 1
    batch: int
    q_len: int  # Lq (1 for the single-query group)
    kv_len: int  # Lk, a multiple of unit
    mask: torch.Tensor  # [B, 1, Lq, Lk]: bool (True = attend), or additive fp32 (0 / -inf) in the single-query group
    chunks: list[tuple[int, int]]  # request ranges [start, end) attended by one SDPA call each; cover 0 .. B


@dataclass
class TorchAttnMetadata:
    groups: list[_Group]


class TorchAttentionBackend:
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        decode_chunk_bytes: int | None = DECODE_CHUNK_BYTES,
    ) -> None:
        """``decode_chunk_bytes``: K+V per SDPA call of the single-query group; None attends the group at once."""
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5
        self.decode_chunk_bytes = decode_chunk_bytes
        # NOTE: one forward at a time per backend: layers reuse these, grown on demand, never shrunk.
        self._scratch: dict[str, torch.Tensor] = {}

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
        qg = q if g.rows is None else q.index_select(0, g.rows)
        if g.q_len == 1:
            return self._attend_single(g, qg.view(g.batch, kv_heads, self.num_heads // kv_heads, d), k_buf, v_buf)
        k = _gather(k_buf, g.kv_index, g.unit).view(g.batch, g.kv_len, kv_heads, d).transpose(1, 2).to(q.dtype)
        v = _gather(v_buf, g.kv_index, g.unit).view(g.batch, g.kv_len, kv_heads, d).transpose(1, 2).to(q.dtype)
        qg = qg.view(g.batch, g.q_len, self.num_heads, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=self.scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(g.batch * g.q_len, -1)
        return out if g.out_sel is None else out.index_select(0, g.out_sel)

    def _attend_single(self, g: _Group, qg: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
        """qg [B, kv_heads, group, d] (the query heads of a KV head on SDPA's query axis) -> [B, heads * d]."""
        rows = max(e - s for s, e in g.chunks) * (g.kv_len // g.unit)
        width = g.unit * self.num_kv_heads * self.head_dim
        scratch = self._scratch_rows("k", rows, width, k_buf), self._scratch_rows("v", rows, width, v_buf)
        if len(g.chunks) == 1:
            return self._attend_chunk(g, 0, g.batch, qg, k_buf, v_buf, scratch)
        out = qg.new_empty(g.batch, self.num_heads * self.head_dim)
        for s, e in g.chunks:
            out[s:e] = self._attend_chunk(g, s, e, qg, k_buf, v_buf, scratch)
        return out

    def _attend_chunk(self, g: _Group, s: int, e: int, qg: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                      scratch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Requests [s, e) of the single-query group: their pages copied into ``scratch``, then one SDPA call."""
        n, kv_heads, d = e - s, self.num_kv_heads, self.head_dim
        index = g.kv_index[s:e].reshape(-1)
        k = _gather(k_buf, index, g.unit, scratch[0][: index.shape[0]])
        v = _gather(v_buf, index, g.unit, scratch[1][: index.shape[0]])
        k = k.view(n, g.kv_len, kv_heads, d).transpose(1, 2).to(qg.dtype)
        v = v.view(n, g.kv_len, kv_heads, d).transpose(1, 2).to(qg.dtype)
        out = F.scaled_dot_product_attention(qg[s:e], k, v, attn_mask=g.mask[s:e], scale=self.scale)
        return out.reshape(n, -1)

    def _scratch_rows(self, name: str, rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """A reusable [rows, width] buffer of ``like``'s dtype and device (first rows * width elements of one tensor)."""
        buf = self._scratch.get(name)
        need = rows * width
        if buf is None or buf.numel() < need or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(need, dtype=like.dtype, device=like.device)
            self._scratch[name] = buf
        return buf[:need].view(rows, width)

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
        tree = None
        if fb.custom_mask is not None:
            q_pos = fb.positions.index_select(0, rows).view(len(idx), q_len)
            tree = (prefix_t, ext_t, _mask_block(fb, idx, jj, ext_t))
        return self._group(fb, idx, [fb.seq_lens_cpu[i] for i in idx], q_pos, rows, out_sel, out_rows, tree)

    def _group(
        self,
        fb: ForwardBatch,
        idx: list[int],
        seq_lens: list[int],
        q_pos: torch.Tensor,
        rows: torch.Tensor | None,
        out_sel: torch.Tensor | None,
        out_rows: torch.Tensor | None,
        tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> _Group:
        """``tree``: (prefix_lens [B, 1], extend_lens [B, 1], the new tokens' mask [B, Lq, Lq]) when
        ``fb.custom_mask`` decides which new keys each query sees (``q_pos`` then the real positions)."""
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
        if tree is not None:
            prefix_t, ext_t, block = tree
            rel = kv_pos[None, :] - prefix_t  # [B, Lk]: index of a key among the new tokens
            in_new = (rel >= 0) & (rel < ext_t)
            seen = block.gather(2, rel.clamp(0, block.shape[2] - 1)[:, None, :].expand(-1, block.shape[1], -1))
            mask = torch.where(in_new[:, None, :], seen, mask)
        unit, kv_index = 1, slots
        if page > 1:
            first = slots[:, ::page]  # [B, Lk / page]
            pages = first // page
            expect = (pages * page).repeat_interleave(page, dim=1) + kv_pos % page
            if bool(((expect == slots) | ~in_seq).all()):
                unit, kv_index = page, torch.where(in_seq[:, ::page], pages, 0)
        single = q_pos.shape[1] == 1
        if single:
            mask = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill_(~mask, float("-inf"))
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
            chunks=self._chunks(b, kv_len, fb.kv_pool.get_key_buffer(0)) if single else [(0, b)],
        )

    def _chunks(self, batch: int, kv_len: int, k_buf: torch.Tensor) -> list[tuple[int, int]]:
        """At most ``MAX_DECODE_CHUNKS`` equal request ranges of ``decode_chunk_bytes`` of K+V each where that allows
        (at least one request per range). Only on CPU, where the point is the cache; a GPU attends in one call."""
        if self.decode_chunk_bytes is None or k_buf.device.type != "cpu":
            return [(0, batch)]
        per_req = 2 * kv_len * self.num_kv_heads * self.head_dim * k_buf.element_size()
        n = min(batch, MAX_DECODE_CHUNKS, max(1, -(-batch * per_req // self.decode_chunk_bytes)))
        size = -(-batch // n)
        return [(s, min(batch, s + size)) for s in range(0, batch, size)]


def _mask_block(fb: ForwardBatch, idx: list[int], jj: torch.Tensor, ext_t: torch.Tensor) -> torch.Tensor:
    """bool [B, Lq, Lq]: ``fb.custom_mask`` of requests ``idx``; padded query rows repeat the last token's row
    (``jj``), padded key columns are False."""
    device = jj.device
    ext = fb.extend_lens_cpu
    starts, total = [], 0
    for n in ext:
        starts.append(total)
        total += n * n
    assert fb.custom_mask is not None and fb.custom_mask.numel() == total, "custom_mask: sum(extend_len^2) entries"
    kk = torch.arange(jj.shape[1], device=device)[None, None, :]
    flat = _i64([starts[i] for i in idx], device)[:, None, None] + jj[:, :, None] * ext_t[:, :, None] + kk
    valid = kk < ext_t[:, :, None]
    return fb.custom_mask.index_select(0, torch.where(valid, flat, 0).reshape(-1)).view(flat.shape) & valid


def _gather(buf: torch.Tensor, kv_index: torch.Tensor, unit: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``kv_index`` of the pool viewed as [num_slots / unit, unit * kv_heads * head_dim] (contiguous copy)."""
    rows = buf.view(buf.shape[0] // unit, -1)
    if out is None:
        return rows.index_select(0, kv_index.reshape(-1))
    return torch.index_select(rows, 0, kv_index.reshape(-1), out=out)


def _i64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
