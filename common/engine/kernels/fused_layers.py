"""Fused element-wise kernels of a Llama decoder layer (the CUDA path): one launch where torch takes several.

    rmsnorm            (residual + x) -> residual, RMSNorm(residual) -> out      torch: ~9 launches, here 1
    rotary_signed_     q and k heads of a fused qkv row, rotated in place      torch: ~5 launches, here 1
    silu_and_mul       silu(gate) * up of a fused gate|up row                  torch: 2 launches, here 1

A bf16 decode step of a 1B model at batch 64 is launch-bound inside its CUDA graph when these run as torch's op
sequences: their many small kernels cost more than the layer's GEMMs (benchmarks/pages/gpu_check.md). Each kernel
rounds where torch's op sequence rounds (every torch op on a half-precision tensor computes in fp32 and rounds its
result to the tensor's dtype), so results match the torch layers bit for bit under the interpreter, and within an
ulp of the dtype on a GPU (where a reduction's order differs, RMSNorm's sum of squares, or ``exp`` is another
implementation, SiLU).

The ``*_ref`` functions are the torch sequences these replace (``common.engine.model.layers``/``rope``); the tests
hold the kernels to them, on CPU through Triton's interpreter and on CUDA at 1B shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / n_cols
    y = (x32 * tl.rsqrt(mean_sq + eps)).to(x.dtype)  # HF: normalise in fp32, cast back, then scale
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` [n, d] (rows may be strided; the last dim contiguous). With ``residual`` [n, d]: the
    residual stream is updated in place (``residual = x + residual``) and RMSNorm of the sum is returned."""
    n, d = x.shape
    if x.stride(-1) != 1 or weight.shape != (d,) or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rmsnorm: rows must be contiguous in the last dim and weight shaped [d]")
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    res = residual if residual is not None else x
    block = triton.next_power_of_2(d)
    _rmsnorm_kernel[(n,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), d, eps,
                          HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
    return weight * x32.to(x.dtype)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, stride_st,
                   HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + cols, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + cols, mask=mask, other=0.0)
    c1 = tl.load(cos_ptr + t * stride_ct + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    dt = x1.dtype
    a1, b1 = x1.to(tl.float32), x2.to(tl.float32)
    # out = x * cos + swap_halves(x) * signed_sin, each product rounded as torch rounds it
    o1 = ((a1 * c1).to(dt).to(tl.float32) + (b1 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((b1 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base + cols, o1, mask=mask)
    tl.store(base + HALF + cols, o2, mask=mask)


def rotary_signed_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_signed`` in place: x [T, heads, head_dim] (a strided view of the qkv rows is fine, head_dim
    contiguous); cos, signed_sin [T, 1, head_dim] or [T, head_dim]. Returns ``x``."""
    t, heads, d = x.shape
    if x.stride(-1) != 1 or d % 2:
        raise ValueError("rotary_signed_: head_dim must be even and contiguous")
    cos, signed_sin = cos.reshape(t, d), signed_sin.reshape(t, d)
    if cos.stride(-1) != 1 or signed_sin.stride(-1) != 1:
        raise ValueError("rotary_signed_: cos/sin rows must be contiguous")
    if t == 0:
        return x
    half = d // 2
    _rotary_kernel[(t, heads)](x, cos, signed_sin, x.stride(0), x.stride(1), cos.stride(0), signed_sin.stride(0),
                               HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1,
                               enable_fp_fusion=False)  # no FMA: the product is rounded before the sum, as in torch
    return x


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)  # F.silu rounds its result
    tl.store(out_ptr + row * stride_out + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [n, 2I] (gate | up) -> silu(gate) * up [n, I]."""
    n, two_i = x.shape
    if x.stride(-1) != 1 or two_i % 2:
        raise ValueError("silu_and_mul: rows must be gate | up, contiguous in the last dim")
    inter = two_i // 2
    out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    if n:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter,
                                                              BLOCK=block, num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up)
