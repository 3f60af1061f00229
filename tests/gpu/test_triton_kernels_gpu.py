"""Triton kernels on CUDA at real shapes (1B-model attention: 32 query / 8 KV heads, head_dim 128) against their
torch references, and the triton backend against the torch backend on the tiny model. Skipped without CUDA.

Tolerances: fp32 1e-4 (IEEE dots); bf16 2e-2 absolute on unit-scale outputs (inputs rounded to bf16, fp32
accumulation on both sides, the kernel's P rounded to bf16 before P·V).
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Triton kernels on GPU)")

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _pool(page_size: int, lens: list[int], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lens) + 8
    num_slots = (num_pages + 1) * page_size
    k_buf = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    v_buf = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    free = list(range(1, num_pages + 1))
    random.Random(seed).shuffle(free)
    req_to_token = torch.zeros(len(lens) + 1, max(lens) + page_size, dtype=torch.int64)
    for i, n in enumerate(lens):
        pages = torch.tensor([free.pop() for _ in range(-(-n // page_size))])
        pos = torch.arange(n)
        req_to_token[i + 1, :n] = pages[pos // page_size] * page_size + pos % page_size
    return k_buf, v_buf, req_to_token.cuda(), torch.arange(1, len(lens) + 1, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,ctx", [(1, 4096), (32, 512), (128, 512), (32, 4096), (4, 16384)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_attention(dtype: torch.dtype, bs: int, ctx: int, page_size: int) -> None:
    from common.engine.kernels.decode_attention import decode_attention, decode_attention_ref

    lens = [max(1, ctx - 37 * i) for i in range(bs)]
    k_buf, v_buf, r2t, rpi = _pool(page_size, lens, dtype)
    q = torch.randn(bs, HEADS, HEAD_DIM, device="cuda").to(dtype)
    seq_lens = torch.tensor(lens, device="cuda")
    for splits in (1, 8, 16):  # each request takes min(splits, its keys / 256) of them, in runs of whole pages
        out = decode_attention(q, k_buf, v_buf, r2t, rpi, seq_lens, HEAD_DIM**-0.5, splits, page_size=page_size)
        ref = decode_attention_ref(q, k_buf, v_buf, r2t, rpi, seq_lens, HEAD_DIM**-0.5)
        assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1000])
def test_extend_attention(dtype: torch.dtype, window: int | None) -> None:
    from common.engine.kernels.extend_attention import extend_attention, extend_attention_ref

    prefix = [0, 1024, 7, 2000, 3000, 0]
    extend = [512, 300, 1, 1, 1024, 64]
    k_buf, v_buf, r2t, rpi = _pool(16, [p + e for p, e in zip(prefix, extend, strict=True)], dtype)
    q = torch.randn(sum(extend), HEADS, HEAD_DIM, device="cuda").to(dtype)
    ext_t = torch.tensor(extend, device="cuda")
    out = extend_attention(q, k_buf, v_buf, r2t, rpi, torch.cumsum(ext_t, 0) - ext_t,
                           torch.tensor(prefix, device="cuda"), ext_t, max(extend), HEAD_DIM**-0.5, window)
    ref = extend_attention_ref(q, k_buf, v_buf, r2t, rpi, prefix, extend, HEAD_DIM**-0.5, window)
    assert (out.float() - ref.float()).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_pages_gather_scatter(dtype: torch.dtype) -> None:
    from common.engine.kernels.kv_pages import gather_pages, gather_pages_ref, scatter_pages

    page_size, num_pages = 16, 2048
    buffers = [torch.randn((num_pages + 1) * page_size, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
               for _ in range(32)]
    page_ids = torch.randperm(num_pages, device="cuda")[:500] + 1
    staging = torch.empty(len(buffers), len(page_ids), page_size, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    expect = torch.empty_like(staging)
    gather_pages(buffers, page_ids, page_size, staging)
    gather_pages_ref(buffers, page_ids, page_size, expect)
    assert torch.equal(staging, expect)
    targets = [torch.zeros_like(b) for b in buffers]
    scatter_pages(targets, page_ids, page_size, staging)
    back = torch.empty_like(staging)
    gather_pages_ref(targets, page_ids, page_size, back)
    assert torch.equal(back, staging)
    untouched = torch.ones(num_pages + 1, dtype=torch.bool, device="cuda")
    untouched[page_ids] = False
    assert not targets[0].view(num_pages + 1, -1)[untouched].any()


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_backend_matches_torch_backend(arch: str) -> None:
    from common.engine.model.loader import load_model
    from common.engine.model.triton_backend import TritonAttentionBackend
    from tests.model_fixtures import PagedHarness, make_tiny_model

    model = load_model(make_tiny_model(arch), device="cuda")[0]
    runs = []
    for backend in ("torch", "triton"):
        h = PagedHarness(model, 16, num_pages=64, max_reqs=4)
        h.pool = h.pool.__class__(64, 16, torch.float32, model.config.num_kv_heads, model.config.head_dim,
                                  model.config.num_layers, "cuda")
        h.req_to_token = h.req_to_token.cuda()
        h.backend = model.make_attn_backend(backend)
        assert isinstance(h.backend, TritonAttentionBackend) == (backend == "triton")
        runs.append(_run_cuda(h))
    for a, b in zip(*runs, strict=True):
        assert (a - b).abs().max().item() <= 1e-4


def _run_cuda(h) -> list[torch.Tensor]:
    """Prefill of two requests, then 4 decode steps; logits of every step, on the host."""
    from common.engine.forward_batch import ForwardBatch, ForwardMode

    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(n)] for i, n in enumerate((300, 77))]
    lens = [0, 0]
    out = []
    steps = [prompts] + [[[11 + t], [12 + t]] for t in range(4)]
    for step in steps:
        ids, pos, locs = [], [], []
        for r, new in enumerate(step):
            for j, tok in enumerate(new):
                p = lens[r] + j
                slot = (1 + r * 32 + p // 16) * 16 + p % 16  # each request owns pages 1 + 32 r ...
                h.req_to_token[r, p] = slot
                ids.append(tok)
                pos.append(p)
                locs.append(slot)
        ext = [len(n) for n in step]
        pre = list(lens)
        lens = [a + b for a, b in zip(lens, ext, strict=True)]
        t = lambda x: torch.tensor(x, dtype=torch.int64, device="cuda")  # noqa: E731
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if all(e == 1 for e in ext) else ForwardMode.EXTEND,
            batch_size=2, input_ids=t(ids), positions=t(pos), out_cache_loc=t(locs), req_pool_indices=t([0, 1]),
            seq_lens=t(lens), extend_lens=t(ext), prefix_lens=t(pre), req_to_token=h.req_to_token,
            seq_lens_cpu=lens, extend_lens_cpu=ext, prefix_lens_cpu=pre, kv_pool=h.pool, attn_backend=h.backend,
        )
        with torch.inference_mode():
            out.append(h.model.compute_logits(h.model(fb)).cpu())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 4096])
def test_fused_layers_at_1b_shapes(dtype: torch.dtype, rows: int) -> None:
    """RMSNorm(+residual), rotary and SiLU·mul kernels against the torch sequences, hidden 2048, intermediate 8192,
    32 + 8 heads of 128: within an ulp or two (reduction order in the norm, exp in SiLU, rounding in rotary)."""
    from common.engine.kernels import fused_layers as fl
    from common.engine.model.rope import apply_rotary_signed

    hidden, inter, eps = 2048, 8192, 1e-5
    ulp = 1e-5 if dtype == torch.float32 else 2e-2
    x = torch.randn(rows, hidden, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    res = torch.randn(rows, hidden, device="cuda").to(dtype)
    res_ref = res.clone()
    got, want = fl.rmsnorm(x, w, eps, residual=res), fl.rmsnorm_ref(x, w, eps, residual=res_ref)
    assert torch.equal(res, res_ref)
    assert (got.float() - want.float()).abs().max().item() <= ulp * 4
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda").to(dtype)
    pos = torch.randint(0, 8192, (rows,), device="cuda")
    freqs = pos.float()[:, None] * (1.0 / 500000 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    sin[..., : HEAD_DIM // 2].neg_()
    view = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM)
    want_rot = apply_rotary_signed(view, cos, sin)
    got_rot = fl.rotary_signed_(view, cos, sin)
    diff = (got_rot.float() - want_rot.float()).abs()
    ulp_rel = 2.0**-23 if dtype == torch.float32 else 2.0**-7
    assert torch.all(diff <= ulp_rel * want_rot.float().abs() + 1e-30), (
        f"rotary: {int((diff > 0).sum())} of {diff.numel()} values differ, max {float(diff.max()):.3g}")
    gu = torch.randn(rows, 2 * inter, device="cuda").to(dtype)
    assert (fl.silu_and_mul(gu).float() - fl.silu_and_mul_ref(gu).float()).abs().max().item() <= ulp * 4


@pytest.mark.parametrize(("layout", "io"), [("layer_first", "kernel"), ("page_first", "direct")])
def test_hicache_host_pages_hold_a_draft_layer_group_on_cuda(layout: str, io: str) -> None:
    from tests.engine.test_hicache import check_layer_groups

    check_layer_groups(layout, io, "cuda")
