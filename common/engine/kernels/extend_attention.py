"""Paged extend attention: new tokens of a ragged batch attend to their cached prefix and, causally, to each other.

Token layout (the ``ForwardBatch`` one) and where keys come from::

    q       [num_tokens, heads, head_dim]   | req0: extend_lens[0] rows | req1: ... |   (rows from q_start[i])
    query j of request i sits at position prefix_lens[i] + j and sees keys 0 .. prefix_lens[i] + j
    (and, with a sliding window W, only keys > position - W).

With a custom mask (a draft tree's verify step; ``ForwardBatch.custom_mask``), query j sees the prefix (within the
sliding window of its own position ``positions[row]``) and new token k iff ``custom_mask[mask_start[i] + j * extend_len
+ k]`` (no window among the new tokens); the mask must stay within the causal order (k <= j), as a tree's ancestor
mask in node order does.

Every key, prefix and new alike, is read from the pool slot ``req_to_token[req_pool_indices[i], pos]``: the
backend writes the new tokens' K/V to the pool before attending, so no separate "extend" K/V operand exists.
One program per (request, query head, block of BLOCK_M queries); blocks past a request's extend_len exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def extend_attention_ref(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    sm_scale: float,
    sliding_window: int | None = None,
    custom_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: one request at a time, dense masked softmax in fp32. Returns [num_tokens, heads, head_dim].
    ``custom_mask`` (bool, flat as the module docstring) with ``positions`` [num_tokens]: the tree form."""
    group = q.shape[1] // k_buf.shape[1]
    out = torch.empty_like(q)
    start, mask_at = 0, 0
    for i, (pre, ext) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        n = pre + ext
        slots = req_to_token[int(req_pool_indices[i]), :n]
        k = k_buf[slots].float().repeat_interleave(group, dim=1)  # [n, heads, d]
        v = v_buf[slots].float().repeat_interleave(group, dim=1)
        qi = q[start : start + ext].float()
        s = torch.einsum("mhd,nhd->hmn", qi, k) * sm_scale
        q_pos = torch.arange(pre, n, device=q.device)[:, None]
        k_pos = torch.arange(n, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if custom_mask is not None and positions is not None:  # the window applies to the prefix only
            q_pos = positions[start : start + ext].to(q.device)[:, None]
            visible = (k_pos < pre).expand(ext, n).clone()
            visible[:, pre:] = custom_mask[mask_at : mask_at + ext * ext].view(ext, ext).to(q.device)
            mask_at += ext * ext
        if sliding_window is not None:
            visible &= (k_pos > q_pos - sliding_window) | (k_pos >= pre if custom_mask is not None else False)
        s = s.masked_fill(~visible, float("-inf"))
        out[start : start + ext] = torch.einsum("hmn,nhd->mhd", s.softmax(-1), v).to(q.dtype)
        start += ext
    return out


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, QStart, PrefixLens, ExtendLens, CustomMask, MaskStart, Positions,
    sm_scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, USE_MASK: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    ext = tl.load(ExtendLens + b)
    if mb * BLOCK_M >= ext:
        return
    pre = tl.load(PrefixLens + b)
    q0 = tl.load(QStart + b)
    row = tl.load(ReqPoolIdx + b)
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < ext
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + (q0 + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    # Keys this block can see: [lo, hi); hi is one past the block's last query (a custom mask is causal too).
    hi = pre + tl.minimum((mb + 1) * BLOCK_M, ext)
    if USE_MASK:
        q_pos = tl.load(Positions + q0 + offs_m, mask=mask_m, other=0)
        mask_row = tl.load(MaskStart + b) + offs_m * ext
        lo = tl.maximum(pre - window + 1, 0)  # a query's position is >= pre
    else:
        q_pos = pre + offs_m
        lo = tl.maximum(pre + mb * BLOCK_M - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=mask_n, other=0)
        k = tl.load(K + slots[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
                    mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if IEEE:
            s = tl.dot(q, k.to(q.dtype), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        in_window = offs_n[None, :] > q_pos[:, None] - window
        if USE_MASK:
            rel = offs_n - pre
            is_new = rel >= 0
            seen = tl.load(CustomMask + mask_row[:, None] + rel[None, :],
                           mask=mask_m[:, None] & is_new[None, :] & mask_n[None, :], other=0)
            visible = tl.where(is_new[None, :], seen != 0, in_window)
        else:
            visible = (offs_n[None, :] <= q_pos[:, None]) & in_window
        visible &= mask_n[None, :]
        s = tl.where(visible, s * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A query row with no visible key in this block keeps m = -inf; guard exp(-inf - -inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (q0 + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    q_start: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 32,
    custom_mask: torch.Tensor | None = None,
    mask_start: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged extend attention; same result as ``extend_attention_ref``. Device int64 [bs] tensors:
    ``q_start`` (first row of each request in q), ``prefix_lens``, ``extend_lens``; ``max_extend_len`` is a host
    int (the grid size), so no device sync happens here. The tree form: ``custom_mask`` (uint8, flat as the module
    docstring), ``mask_start`` (int64 [bs], each request's first entry) and ``positions`` (int64 [num_tokens])."""
    bs = req_pool_indices.shape[0]
    _, heads, d = q.shape
    group = heads // k_buf.shape[1]
    if out is None:
        out = torch.empty_like(q)
    window = sliding_window if sliding_window is not None else 1 << 30
    use_mask = custom_mask is not None
    if use_mask and (mask_start is None or positions is None):
        raise ValueError("extend_attention: a custom_mask needs mask_start and positions")
    _extend_kernel[(bs, heads, triton.cdiv(max_extend_len, block_m))](
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, q_start, prefix_lens, extend_lens,
        custom_mask if use_mask else q_start, mask_start if use_mask else q_start,
        positions if use_mask else q_start,
        sm_scale, window,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d),
        IEEE=q.dtype == torch.float32, USE_MASK=use_mask,
    )
    return out
