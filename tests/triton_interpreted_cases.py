"""Triton kernels vs their torch references, run under Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Run as ``python -m tests.triton_interpreted_cases OUT.json`` with ``TRITON_INTERPRET=1`` set (``test_triton_kernels``
does this in a subprocess). Importing this module does not import Triton: the case names are plain data, so the
test module can parametrize over them.

Every case builds a pool whose slots follow the paged allocator's layout (token ``i`` of a request at offset
``i % page_size`` of one of its pages, pages shuffled over the pool; page 0 is padding). bf16 is left to the GPU
tests: the interpreter's ``tl.dot`` mis-reads bf16 operands (triton 3.9), fp16 stands in for half precision.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
from collections.abc import Callable

import torch

KV_HEADS = 2


def _kv_heads(group: int) -> int:
    return 1 if group >= 8 else KV_HEADS  # 8 query heads either way: keeps the interpreter's program count down


def _pool(page_size: int, lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """K/V buffers and a req_to_token table holding each request's ``lens[i]`` keys in row ``i + 1``."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-n // page_size) for n in lens)
    num_pages = pages_needed + 3
    num_slots = (num_pages + 1) * page_size
    k_buf = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    free = list(range(1, num_pages + 1))
    random.Random(seed).shuffle(free)
    width = max(lens) + page_size
    req_to_token = torch.zeros(len(lens) + 1, width, dtype=torch.int64)
    for i, n in enumerate(lens):
        pages = [free.pop() for _ in range(-(-n // page_size))]
        pos = torch.arange(n)
        req_to_token[i + 1, :n] = torch.tensor(pages)[pos // page_size] * page_size + pos % page_size
    return k_buf, v_buf, req_to_token, torch.arange(1, len(lens) + 1)


def _check(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol}"
    return err


def decode_case(page_size: int, group: int, dtype: torch.dtype = torch.float32, window: int | None = None,
                splits: int = 3) -> float:
    from common.engine.kernels.decode_attention import decode_attention, decode_attention_ref

    lens = [1, 5, 16, 33, 50]
    d = 48
    kvh = _kv_heads(group)
    k_buf, v_buf, r2t, rpi = _pool(page_size, lens, kvh, d, dtype, seed=page_size * 10 + group)
    q = torch.randn(len(lens), kvh * group, d, generator=torch.Generator().manual_seed(group)).to(dtype)
    seq_lens = torch.tensor(lens)
    # 8 keys a split (the real minimum is 256): these short contexts still take several splits
    out = decode_attention(q, k_buf, v_buf, r2t, rpi, seq_lens, d**-0.5, splits, window, page_size=page_size,
                           min_keys_per_split=8)
    ref = decode_attention_ref(q, k_buf, v_buf, r2t, rpi, seq_lens, d**-0.5, window)
    return _check(out, ref, 1e-5 if dtype == torch.float32 else 2e-3)


def decode_splits_case() -> float:
    """Split-K by each request's own length in one grid (as a CUDA graph fixes it): a short request takes one split,
    a long one one per ``min_keys_per_split`` keys up to the grid's, each a run of whole pages (``kv_splits``); the
    merged output still matches the reference."""
    from common.engine.kernels.decode_attention import (
        decode_attention,
        decode_attention_ref,
        decode_attention_splits,
        kv_splits,
    )

    lens, page, grid, min_keys, d = [3, 20, 70], 4, 8, 5, 16
    k_buf, v_buf, r2t, rpi = _pool(page, lens, 1, d, torch.float32, seed=5)
    q = torch.randn(len(lens), 2, d, generator=torch.Generator().manual_seed(5))
    seq_lens = torch.tensor(lens)
    _, lse = decode_attention_splits(q, k_buf, v_buf, r2t, rpi, seq_lens, d**-0.5, grid, page_size=page,
                                     min_keys_per_split=min_keys)
    used = torch.isfinite(lse[:, 0]).sum(-1).tolist()
    assert [len(kv_splits(n, grid, page, min_keys)) for n in lens] == used == [1, 3, 6], used  # [1, 5, 6] all 8 splits, [1, 4, 8] unaligned
    assert kv_splits(70, grid, page, min_keys) == [(0, 12), (12, 24), (24, 36), (36, 48), (48, 60), (60, 70)]
    out = decode_attention(q, k_buf, v_buf, r2t, rpi, seq_lens, d**-0.5, grid, page_size=page,
                           min_keys_per_split=min_keys)
    return _check(out, decode_attention_ref(q, k_buf, v_buf, r2t, rpi, seq_lens, d**-0.5), 1e-5)


def paged_torch_case(page_size: int, group: int) -> float:
    """The gather-free torch decode (blocks of pages) against the same oracle; block_pages=2 forces several blocks."""
    from common.engine.kernels.decode_attention import decode_attention_ref
    from common.engine.kernels.paged_decode_torch import page_table, paged_decode_torch

    lens = [1, 5, 16, 33, 70]
    d = 48
    kvh = _kv_heads(group)
    k_buf, v_buf, r2t, rpi = _pool(page_size, lens, kvh, d, torch.float32, seed=page_size * 10 + group + 2)
    q = torch.randn(len(lens), kvh * group, d, generator=torch.Generator().manual_seed(group))
    seq_lens = torch.tensor(lens)
    pages = page_table(r2t, rpi, max(lens), page_size)
    out = paged_decode_torch(q, k_buf, v_buf, pages, seq_lens, page_size, d**-0.5, block_pages=max(1, 32 // page_size))
    ref = decode_attention_ref(q, k_buf, v_buf, r2t, rpi, seq_lens, d**-0.5)
    return _check(out, ref, 1e-5)


def extend_case(page_size: int, group: int, dtype: torch.dtype = torch.float32, window: int | None = None) -> float:
    from common.engine.kernels.extend_attention import extend_attention, extend_attention_ref

    # A mixed batch: a fresh prefill, prefix hits (page-aligned and not), 1-token extends (decodes), a long chunk.
    prefix = [0, 16, 3, 40, 0, 17]
    extend = [9, 20, 1, 1, 40, 5]
    d = 48
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    kvh = _kv_heads(group)
    k_buf, v_buf, r2t, rpi = _pool(page_size, lens, kvh, d, dtype, seed=page_size * 10 + group + 1)
    heads = kvh * group
    q = torch.randn(sum(extend), heads, d, generator=torch.Generator().manual_seed(group)).to(dtype)
    ext_t = torch.tensor(extend)
    q_start = torch.cumsum(ext_t, 0) - ext_t
    out = extend_attention(q, k_buf, v_buf, r2t, rpi, q_start, torch.tensor(prefix), ext_t, max(extend), d**-0.5,
                           window, block_m=32, block_n=16)
    ref = extend_attention_ref(q, k_buf, v_buf, r2t, rpi, prefix, extend, d**-0.5, window)
    return _check(out, ref, 1e-5 if dtype == torch.float32 else 2e-3)


def extend_tree_case(page_size: int, window: int | None = None) -> float:
    """A draft tree's verify: the kernel's custom-mask form (through ``TritonAttentionBackend``, which builds the
    mask offsets) against the oracle; the tree must change the result (else a causal kernel would pass)."""
    from common.engine.forward_batch import ForwardBatch, ForwardMode
    from common.engine.kernels.extend_attention import extend_attention_ref
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.model.triton_backend import TritonAttentionBackend
    from common.engine.spec.eagle_tree import ancestor_mask

    prefix, extend = [5, 17, 0], [6, 4, 3]
    d, kvh, heads = 32, KV_HEADS, 2 * KV_HEADS
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    k_buf, v_buf, r2t, rpi = _pool(page_size, lens, kvh, d, torch.float32, seed=page_size + 7)
    gen = torch.Generator().manual_seed(page_size)
    masks, positions = [], []
    for p, e in zip(prefix, extend, strict=True):
        parents = torch.tensor([[-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, e)]])
        mask = ancestor_mask(parents, e)[0]
        masks.append(mask.reshape(-1))
        positions.append(p + mask.sum(1) - 1)
    mask, pos = torch.cat(masks), torch.cat(positions)
    q = torch.randn(sum(extend), heads, d, generator=gen)
    pool = MHATokenToKVPool(k_buf.shape[0] // page_size - 1, page_size, torch.float32, kvh, d, 1)
    pool.k_buffer[0], pool.v_buffer[0] = k_buf, v_buf
    out_loc = torch.cat([r2t[i + 1, p:n] for i, (p, n) in enumerate(zip(prefix, lens, strict=True))])
    backend = TritonAttentionBackend(heads, kvh, d, window, "cpu")
    fb = ForwardBatch(ForwardMode.EXTEND, 3, torch.zeros(sum(extend), dtype=torch.int64), pos, out_loc, rpi,
                      torch.tensor(lens), torch.tensor(extend), torch.tensor(prefix), r2t, lens, extend, prefix, pool,
                      backend, custom_mask=mask)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k_buf[out_loc].clone(), v_buf[out_loc].clone(), 0, fb).view_as(q)
    ref = extend_attention_ref(q, k_buf, v_buf, r2t, rpi, prefix, extend, d**-0.5, window, mask, pos)
    causal = extend_attention_ref(q, k_buf, v_buf, r2t, rpi, prefix, extend, d**-0.5, window)
    assert (ref - causal).abs().max() > 1e-3, "the tree changed nothing"
    return _check(out, ref, 1e-5)


def kv_pages_case(page_size: int, dtype: torch.dtype) -> float:
    from common.engine.kernels.kv_pages import gather_pages_ref, scatter_pages_ref
    from common.engine.kernels.kv_pages_triton import gather_pages_triton, scatter_pages_triton

    num_pages, slot = 9, (KV_HEADS, 48)
    gen = torch.Generator().manual_seed(page_size)
    buffers = [torch.randn((num_pages + 1) * page_size, *slot, generator=gen).to(dtype) for _ in range(6)]
    page_ids = torch.tensor([7, 2, 9, 1])
    staging = torch.full((len(buffers), len(page_ids), page_size, *slot), -1.0).to(dtype)
    expect = torch.empty_like(staging)
    gather_pages_triton(buffers, page_ids, page_size, staging)
    gather_pages_ref(buffers, page_ids, page_size, expect)
    assert torch.equal(staging, expect), "gather_pages: triton and reference differ"
    got = [torch.zeros_like(b) for b in buffers]
    want = [torch.zeros_like(b) for b in buffers]
    scatter_pages_triton(got, page_ids, page_size, expect)
    scatter_pages_ref(want, page_ids, page_size, expect)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), "scatter_pages: triton and reference differ"
    from common.engine.kernels.kv_pages import copy_pages_ref
    from common.engine.kernels.kv_pages_triton import copy_pages_triton

    ids = torch.stack([page_ids, torch.tensor([3, 8, 1, 5])])
    got, want = [torch.zeros_like(b) for b in buffers], [torch.zeros_like(b) for b in buffers]
    copy_pages_triton(buffers, got, ids, page_size)
    copy_pages_ref(buffers, want, ids, page_size)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), "copy_pages: triton and reference differ"
    from common.engine.kernels.kv_pages_triton import PageCopier

    copier = PageCopier(buffers, got, page_size)  # built once, then each call only launches (the shm worker's way)
    for more in (torch.tensor([[4, 6], [2, 7]]), torch.tensor([[8], [9]])):
        copier(more)
        copy_pages_ref(buffers, want, more, page_size)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), "PageCopier: a later call differs"
    try:
        copier(torch.tensor([[1, 2]]))
    except ValueError:
        pass
    else:
        raise AssertionError("PageCopier accepted ids that are not [2, n]")
    for bad_ids, bad_staging in ((page_ids, staging[:, :3]), (page_ids.int(), staging)):
        try:
            gather_pages_triton(buffers, bad_ids, page_size, bad_staging)
        except ValueError:
            continue
        raise AssertionError("gather_pages_triton accepted a mis-shaped staging tensor or int32 page ids")
    return 0.0


def fused_layers_case(dtype: torch.dtype) -> float:
    """RMSNorm (with and without the residual add, strided rows), in-place rotary over a qkv row's q|k heads and
    SiLU·mul against the torch sequences they replace. Rotary rounds exactly as torch does: equal bit for bit."""
    from common.engine.kernels import fused_layers as fl
    from common.engine.model.rope import apply_rotary_signed

    gen = torch.Generator().manual_seed(3)
    n, d, eps = 5, 80, 1e-6  # d not a power of two: masked columns
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    weight = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype)
    rows = torch.randn(n, 2 * d, generator=gen).to(dtype)[:, :d]  # strided rows
    worst = _check(fl.rmsnorm(rows, weight, eps), fl.rmsnorm_ref(rows, weight, eps), tol)
    res, res_ref = (torch.randn(n, d, generator=gen).to(dtype) for _ in range(2))
    res_ref.copy_(res)
    worst = max(worst, _check(fl.rmsnorm(rows, weight, eps, residual=res),
                              fl.rmsnorm_ref(rows, weight, eps, residual=res_ref), tol))
    worst = max(worst, _check(res, res_ref, 0.0))  # the residual stream: one rounded add on both sides
    heads_q, heads_kv, hd = 4, 2, 16
    qkv = torch.randn(n, (heads_q + 2 * heads_kv) * hd, generator=gen).to(dtype)
    pos = torch.tensor([0, 1, 7, 300, 4095])
    freqs = pos.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    sin[..., : hd // 2].neg_()
    view = qkv[:, : (heads_q + heads_kv) * hd].view(n, heads_q + heads_kv, hd)
    want = apply_rotary_signed(view, cos, sin)
    v_before = qkv[:, (heads_q + heads_kv) * hd :].clone()
    fl.rotary_signed_(view, cos, sin)
    assert torch.equal(view, want), "rotary: kernel and torch differ"
    assert torch.equal(qkv[:, (heads_q + heads_kv) * hd :], v_before), "rotary touched the v heads"
    gate_up = torch.randn(n, 2 * 1500, generator=gen).to(dtype)  # 1500: two column blocks, the last masked
    return max(worst, _check(fl.silu_and_mul(gate_up), fl.silu_and_mul_ref(gate_up), tol))


def _whole(name: str, *args: object, **kwargs: object) -> float:
    """A whole-model case (tests/triton_interpreted_model_cases.py, which reuses ``_check`` from here)."""
    from tests import triton_interpreted_model_cases

    return getattr(triton_interpreted_model_cases, name)(*args, **kwargs)


F32, F16 = torch.float32, torch.float16
CASES: dict[str, Callable[[], float]] = {}
for _ps in (1, 16):
    for _g in (1, 4, 8):
        CASES[f"decode-page{_ps}-gqa{_g}"] = lambda ps=_ps, g=_g: decode_case(ps, g)
        CASES[f"extend-page{_ps}-gqa{_g}"] = lambda ps=_ps, g=_g: extend_case(ps, g)
        CASES[f"paged_torch-page{_ps}-gqa{_g}"] = lambda ps=_ps, g=_g: paged_torch_case(ps, g)
    for _dt in (F32, F16):
        CASES[f"kv_pages-page{_ps}-{str(_dt)[6:]}"] = lambda ps=_ps, dt=_dt: kv_pages_case(ps, dt)
CASES["decode-fp16-gqa4"] = lambda: decode_case(16, 4, F16)
CASES["decode-window-split4"] = lambda: decode_case(16, 4, window=20, splits=4)
CASES["decode-one-split"] = lambda: decode_case(16, 8, splits=1)
CASES["decode-splits-by-length"] = decode_splits_case
CASES["extend-fp16-gqa4"] = lambda: extend_case(16, 4, F16)
CASES["extend-window"] = lambda: extend_case(1, 4, window=12)
CASES["extend-tree-page16"] = lambda: extend_tree_case(16)
CASES["extend-tree-window"] = lambda: extend_tree_case(1, window=4)
CASES["fused-layers-fp32"] = lambda: fused_layers_case(F32)
CASES["fused-layers-fp16"] = lambda: fused_layers_case(F16)
CASES["model-llama-page16"] = lambda: _whole("model_case", "llama", 16)
CASES["model-mistral-window"] = lambda: _whole("model_case", "mistral", 16, first_len=56)  # tiny window: 48
CASES["engine-llama"] = lambda: _whole("engine_case")
CASES["graph-runner-llama"] = lambda: _whole("graph_runner_case", "llama")
CASES["spec-graph-runners"] = lambda: _whole("spec_graph_runners_case")


def main(out_path: str) -> None:
    results = {}
    for name, case in CASES.items():
        start = time.process_time()
        try:
            results[name] = {"ok": True, "max_err": case()}
        except Exception:  # every failure is reported to the test that owns the case
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["cpu_s"] = round(time.process_time() - start, 2)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
