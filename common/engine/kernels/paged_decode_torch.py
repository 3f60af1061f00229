"""Paged decode attention in plain torch, reading the pool a block of pages at a time (no [B, Lk] K/V copy).

The page table of a batch comes from ``req_to_token`` (page-aligned slots: key ``j`` of a request sits at offset
``j % page_size`` of page ``page_table[i, j // page_size]``)::

    page_table[i, p] = req_to_token[req_pool_indices[i], p * page_size] // page_size     p < ceil(max_len / P)

Keys are visited in blocks of ``block_pages`` pages (``block_pages * page_size`` keys) for every request at once,
with an online softmax across blocks; only one block of K/V (``[B, block_pages * page_size, kv_heads, d]``) exists
at any time, so the working set stays in cache however long the context is. Padded keys read page 0 (padding)
and are masked. GQA: the query heads of one KV head share its block.
"""

from __future__ import annotations

import torch


def page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_len: int, page_size: int) -> torch.Tensor:
    """int64 [B, ceil(max_len / page_size)] page ids of each request's keys (entries past its length are junk)."""
    width = -(-max_len // page_size) * page_size
    first_slots = req_to_token.index_select(0, req_pool_indices)[:, :width:page_size]
    return first_slots // page_size


def paged_decode_torch(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    block_pages: int = 64,
) -> torch.Tensor:
    """q [B, heads, d]; pages from ``page_table``; seq_lens int64 [B] on q's device. Returns [B, heads, d]."""
    bs, heads, d = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    k_pages = k_buf.view(-1, page_size, kv_heads, d)
    v_pages = v_buf.view(-1, page_size, kv_heads, d)
    qg = q.view(bs, kv_heads, group, d).float() * sm_scale
    m = torch.full((bs, kv_heads, group, 1), float("-inf"), device=q.device)
    denom = torch.zeros(bs, kv_heads, group, 1, device=q.device)
    acc = torch.zeros(bs, kv_heads, group, d, device=q.device)
    num_pages = pages.shape[1]
    for p0 in range(0, num_pages, block_pages):
        blk = pages[:, p0 : p0 + block_pages]
        n = blk.shape[1] * page_size
        valid = (p0 * page_size + torch.arange(n, device=q.device))[None, :] < seq_lens[:, None]  # [B, n]
        blk = torch.where(valid[:, ::page_size], blk, 0)
        # [B, n, kv_heads, d] -> [B, kv_heads, d, n] / [B, kv_heads, n, d]
        k = k_pages.index_select(0, blk.reshape(-1)).view(bs, n, kv_heads, d).permute(0, 2, 3, 1).float()
        v = v_pages.index_select(0, blk.reshape(-1)).view(bs, n, kv_heads, d).transpose(1, 2).float()
        s = torch.matmul(qg, k).masked_fill_(~valid[:, None, None, :], float("-inf"))  # [B, kvh, group, n]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new)
        acc = acc * alpha + torch.matmul(p, v)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        m = m_new
    return (acc / denom).view(bs, heads, d).to(q.dtype)
