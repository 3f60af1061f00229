"""``TorchAttentionBackend`` (the CPU path) against a plain per-request reference on random paged pools.

Pools hold random K/V in shuffled pages; batches mix sequence lengths (1 to a few pages, partial last pages),
page sizes 1 and 16, GQA and MHA, decode-only and mixed (decode + multi-token extend) batches, and the decode
group attended at once, in the default chunks and in one-request chunks. Every case is within 1e-5 (fp32) of the
reference and of the other chunkings.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.model import attention as attention_module
from common.engine.model.attention import MAX_DECODE_CHUNKS, TorchAttentionBackend


def _paged_batch(
    rng: random.Random, extend_lens: list[int], seq_lens: list[int], page: int, kv_heads: int, d: int,
    aligned: bool = True,
) -> ForwardBatch:
    """Requests i: keys 0 .. seq_lens[i] - 1 in shuffled pages of a fresh pool (the last extend_lens[i] are new)."""
    pages_per_req = [-(-n // page) for n in seq_lens]
    num_pages = sum(pages_per_req) + 3
    pool = MHATokenToKVPool(num_pages, page, torch.float32, kv_heads, d, 1)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gen))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gen))
    free = list(range(1, num_pages + 1))
    rng.shuffle(free)
    width = max(seq_lens) + 2 * page
    req_to_token = torch.zeros(len(seq_lens) + 2, width, dtype=torch.int64)
    pool_rows = rng.sample(range(1, len(seq_lens) + 2), len(seq_lens))
    if aligned:
        for row, n, m in zip(pool_rows, seq_lens, pages_per_req, strict=True):
            pages = torch.tensor([free.pop() for _ in range(m)])
            pos = torch.arange(n)
            req_to_token[row, :n] = pages[pos // page] * page + pos % page
    else:  # every key in a slot of its own, anywhere in the pool
        slots = rng.sample(range(page, (num_pages + 1) * page), sum(seq_lens))
        for row, n in zip(pool_rows, seq_lens, strict=True):
            req_to_token[row, :n] = torch.tensor([slots.pop() for _ in range(n)])
    out_cache_loc = torch.cat([req_to_token[r, n - e : n] for r, n, e in zip(pool_rows, seq_lens, extend_lens,
                                                                                 strict=True)])
    prefix = [n - e for n, e in zip(seq_lens, extend_lens, strict=True)]
    positions = torch.cat([torch.arange(p, n) for p, n in zip(prefix, seq_lens, strict=True)])
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.MIXED
    return ForwardBatch(
        forward_mode=mode, batch_size=len(seq_lens), input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64),
        positions=positions, out_cache_loc=out_cache_loc, req_pool_indices=i64(pool_rows), seq_lens=i64(seq_lens),
        extend_lens=i64(extend_lens), prefix_lens=i64(prefix), req_to_token=req_to_token,
        seq_lens_cpu=seq_lens, extend_lens_cpu=extend_lens, prefix_lens_cpu=prefix, kv_pool=pool, attn_backend=None,
    )


def _reference(fb: ForwardBatch, q: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """One new token at a time: softmax over keys 0 .. its position (the last ``window`` of them) of the pool."""
    k_buf, v_buf = fb.kv_pool.k_buffer[0].double(), fb.kv_pool.v_buffer[0].double()
    group = q.shape[1] // k_buf.shape[1]
    out, t = torch.empty(q.shape, dtype=torch.float64), 0
    for i, (n, e) in enumerate(zip(fb.seq_lens_cpu, fb.extend_lens_cpu, strict=True)):
        for pos in range(n - e, n):
            lo = 0 if window is None else max(0, pos + 1 - window)
            slots = fb.req_to_token[int(fb.req_pool_indices[i]), lo : pos + 1]
            k = k_buf[slots].repeat_interleave(group, dim=1)  # [keys, heads, d]
            v = v_buf[slots].repeat_interleave(group, dim=1)
            p = (torch.einsum("hd,nhd->hn", q[t].double(), k) * scale).softmax(-1)
            out[t] = torch.einsum("hn,nhd->hd", p, v)
            t += 1
    return out.reshape(q.shape[0], -1).float()


def _attend(fb: ForwardBatch, backend: TorchAttentionBackend, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> torch.Tensor:
    fb.attn_backend, fb.attn_metadata = backend, None
    backend.init_forward_metadata(fb)
    return backend.forward(q, k, v, 0, fb)


CASES = [  # (page, heads, kv_heads, extend_lens, seq_lens, page-aligned slots)
    (16, 8, 2, [1] * 7, [1, 16, 17, 40, 33, 64, 5], True),
    (1, 8, 2, [1] * 5, [1, 2, 31, 9, 50], True),
    (16, 4, 4, [1, 6, 1, 1, 20], [47, 6, 16, 80, 37], True),
    (16, 8, 2, [1, 1, 3, 1], [19, 70, 12, 2], False),
    (1, 6, 3, [1, 9, 1], [12, 30, 3], True),
]


@pytest.mark.parametrize(("page", "heads", "kv_heads", "extend_lens", "seq_lens", "aligned"), CASES)
@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_matches_reference(
    page: int, heads: int, kv_heads: int, extend_lens: list[int], seq_lens: list[int], aligned: bool,
    window: int | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(attention_module, "MAX_DECODE_CHUNKS", 64)  # let the smallest budget reach one request
    rng, d = random.Random(page * 100 + heads + len(seq_lens)), 32
    fb = _paged_batch(rng, extend_lens, seq_lens, page, kv_heads, d, aligned)
    gen = torch.Generator().manual_seed(5)
    t = sum(extend_lens)
    q = torch.randn(t, heads, d, generator=gen)
    k, v = torch.randn(t, kv_heads, d, generator=gen), torch.randn(t, kv_heads, d, generator=gen)
    one_request = 2 * max(seq_lens) * kv_heads * d * 4  # below one request's K+V: one request per SDPA call
    outs = {
        chunk: _attend(fb, TorchAttentionBackend(heads, kv_heads, d, window, decode_chunk_bytes=chunk), q, k, v)
        for chunk in (None, 1 << 22, one_request // 2)
    }
    singles = sum(e == 1 for e in extend_lens)
    assert len(fb.attn_metadata.groups[0].chunks) == singles  # the last backend ran one request per call
    assert fb.attn_metadata.groups[0].unit == (page if aligned else 1)
    ref = _reference(fb, q, d**-0.5, window)
    for chunk, out in outs.items():
        assert out.shape == (t, heads * d)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0, msg=f"decode_chunk_bytes={chunk}")
        torch.testing.assert_close(out, outs[None], atol=1e-5, rtol=0)


def test_decode_chunks_cover_the_batch_in_equal_ranges_and_reuse_scratch() -> None:
    """64 requests of 160 keys (160 KiB of K+V each at 2 x 64 fp32): a 4 MiB budget gives 3 ranges of <= 22; a
    1 MiB one would give 10, capped at MAX_DECODE_CHUNKS."""
    k_buf = torch.empty(16, 2, 64)
    chunks = TorchAttentionBackend(8, 2, 64, decode_chunk_bytes=4 << 20)._chunks(64, 160, k_buf)
    assert chunks == [(0, 22), (22, 44), (44, 64)]
    backend = TorchAttentionBackend(8, 2, 64, decode_chunk_bytes=1 << 20)
    chunks = backend._chunks(64, 160, k_buf)
    assert len(chunks) == MAX_DECODE_CHUNKS and chunks[-1][1] == 64
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    assert backend._chunks(3, 1 << 16, k_buf) == [(0, 1), (1, 2), (2, 3)]  # never below one request
    first = backend._scratch_rows("k", 10, 128, k_buf)
    again = backend._scratch_rows("k", 4, 128, k_buf)
    assert again.data_ptr() == first.data_ptr()  # layers of one forward reuse one buffer
