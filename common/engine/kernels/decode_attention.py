"""Paged decode attention: one query token per request, K/V read straight from the pool through ``req_to_token``.

Inputs (no per-request gather; every key is loaded from its pool slot)::

    q            [bs, heads, head_dim]               the new token of each request
    k_buf, v_buf [num_slots, kv_heads, head_dim]      one layer's pool buffers
    req_to_token [pool_size, max_context_len] int64   slot of key j of request i: req_to_token[req_pool_indices[i], j]
    seq_lens     [bs] int64                           keys 0 .. seq_len-1 are visible (the query sits at seq_len-1)

With a sliding window W the visible keys are ``[max(0, seq_len - W), seq_len)``.

Split-K (flash-decoding): the grid has ``num_kv_splits`` programs per (request, kv head), fixed by the caller (a
CUDA graph fixes it per captured batch size); each request uses as many of them as its own context length asks for
(``kv_splits``: one per ``min_keys_per_split`` visible keys, at most ``num_kv_splits``), computed on the device from
its ``seq_len``, in runs of whole pages. Stage 1 runs one program per (request, kv head, split) over all query heads
of that kv head (GQA: K/V read once per group) and writes a normalized partial output and its log-sum-exp; stage 2
merges the splits. A split with no keys (beyond the request's own count) writes lse = -inf and weighs nothing in
stage 2. So a short request in a batch with long ones costs one split, and a long one is spread over many programs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MIN_KEYS_PER_SPLIT = 256


def kv_splits(kv_len: int, num_kv_splits: int, page_size: int, min_keys_per_split: int) -> list[tuple[int, int]]:
    """The [start, end) key runs (from the first visible key) a request of ``kv_len`` visible keys is split into:
    what ``_decode_stage1`` computes on the device, for tests and docs. Empty runs are left out."""
    splits = min(num_kv_splits, max(1, math.ceil(kv_len / min_keys_per_split)))
    per = math.ceil(math.ceil(kv_len / splits) / page_size) * page_size
    return [(s * per, min((s + 1) * per, kv_len)) for s in range(splits) if s * per < kv_len]


def decode_attention_ref(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The oracle: one request at a time, fp32 softmax. Returns [bs, heads, head_dim] in q's dtype."""
    bs, heads, _ = q.shape
    group = heads // k_buf.shape[1]
    out = torch.empty_like(q)
    for i in range(bs):
        n = int(seq_lens[i])
        lo = 0 if sliding_window is None else max(0, n - sliding_window)
        slots = req_to_token[int(req_pool_indices[i]), lo:n]
        k = k_buf[slots].float().repeat_interleave(group, dim=1)  # [n, heads, d]
        v = v_buf[slots].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * sm_scale
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out


@triton.jit
def _decode_stage1(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse,
    sm_scale, window,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE: tl.constexpr,
    MIN_KEYS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(ReqPoolIdx + b)
    lo = tl.maximum(seq_len - window, 0)
    # this request's own split count (by its length) and run length (whole pages): see kv_splits
    kv_len = seq_len - lo
    splits = tl.minimum(tl.maximum(tl.cdiv(kv_len, MIN_KEYS), 1), NUM_SPLITS)
    per_split = tl.cdiv(tl.cdiv(kv_len, splits), PAGE) * PAGE
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=mask_n, other=0)
        k = tl.load(K + slots[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if IEEE:
            s = tl.dot(q, k.to(q.dtype), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        # NOTE: fp32 whatever sm_scale arrives as (inductor passes a Python float as fp64 when it compiles this
        # kernel inside a torch.compile'd forward; m_i would then change type in the loop)
        s = tl.where(mask_n[None, :], (s * sm_scale).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    has = end > start
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(MidO + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :], out,
             mask=mask_h[:, None] & mask_d[None, :])
    tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    MidO, MidLse, Out,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)  # split 0 is never empty (seq_len >= 1), so m is finite
    w = tl.exp(lse - m)
    o = tl.load(MidO + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention_splits(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int,
    sliding_window: int | None = None,
    page_size: int = 1,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
    block_n: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 alone: (partial outputs [bs, heads, num_kv_splits, head_dim], their log-sum-exps [bs, heads,
    num_kv_splits], -inf for a split with no keys), fp32."""
    bs, heads, d = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    mid_o = torch.empty(bs, heads, num_kv_splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(bs, heads, num_kv_splits, dtype=torch.float32, device=q.device)
    window = sliding_window if sliding_window is not None else 1 << 30
    _decode_stage1[(bs, kv_heads, num_kv_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        sm_scale, window,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=d, NUM_SPLITS=num_kv_splits, PAGE=page_size, MIN_KEYS=min_keys_per_split,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d),
        IEEE=q.dtype == torch.float32,
    )
    return mid_o, mid_lse


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    page_size: int = 1,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
    block_n: int = 32,
) -> torch.Tensor:
    """Triton paged decode attention; same result as ``decode_attention_ref``. ``q`` [bs, heads, head_dim] must
    have a contiguous last dim; ``num_kv_splits`` (the grid's splits per request and kv head, the most a request
    uses) is chosen by the caller on the host (no device sync here); ``page_size`` aligns the splits' runs."""
    bs, heads, d = q.shape
    mid_o, mid_lse = decode_attention_splits(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, sm_scale,
                                             num_kv_splits, sliding_window, page_size, min_keys_per_split, block_n)
    if out is None:
        out = torch.empty_like(q)
    block_d = triton.next_power_of_2(d)
    _decode_stage2[(bs, heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, NUM_SPLITS=num_kv_splits, BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)), BLOCK_D=block_d,
    )
    return out
