"""Building blocks of Llama-family decoders. Parameters are allocated uninitialised: the loader fills them all.

Tensor parallelism: a column-parallel layer is a plain ``Linear`` over this rank's output rows (the loader reads
those rows); ``RowParallelLinear`` holds this rank's input columns and sums the partial outputs over the group.

CPU GEMMs: ``Linear.pack_for_cpu`` reorders an fp32 or bf16 weight once into oneDNN's blocked layout and the layer
then multiplies through oneDNN (``torch.ops.mkldnn._linear_pointwise``, what inductor emits for frozen CPU
linears) instead of ``F.linear``'s call, which re-packs the weight on every call and in fp32 goes to the BLAS
(MKL), which on non-Intel CPUs runs a narrower code path than the CPU has. In fp32 the two sum in a different
order: results agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.distributed import TPGroup

logger = logging.getLogger(__name__)


@functools.cache
def fused_layers() -> ModuleType:
    """The Triton kernels module, imported on first use (Triton is not imported on the torch path)."""
    from common.engine.kernels import fused_layers as module

    return module


# The probe's tolerance per dtype packed (|oneDNN - F.linear| <= tol * max(1, max |F.linear|)): the dtype's rounding.
ONEDNN_PROBE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@functools.cache
def onednn_linear_ok(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN linear runs ``dtype`` on this CPU (bf16: where oneDNN has native bf16 kernels)
    and agrees with ``F.linear`` on a probe; logs why not (once per dtype)."""
    if dtype not in ONEDNN_PROBE_TOL or not torch.backends.mkldnn.is_available():
        return False
    try:
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 40, generator=gen).to(dtype), torch.randn(3, 40, generator=gen).to(dtype)
        ref = F.linear(x, w).float()
        got = onednn_linear(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None).float()
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        logger.warning("oneDNN linear unavailable for %s (%s): CPU GEMMs stay on F.linear", dtype, e)
        return False
    err = (got - ref).abs().max().item()
    if not err <= ONEDNN_PROBE_TOL[dtype] * max(1.0, ref.abs().max().item()):
        logger.warning("oneDNN linear off by %.3g on a %s probe: CPU GEMMs stay on F.linear", err, dtype)
        return False
    return True


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] on CPU in oneDNN's layout for ``onednn_linear``; None where ``onednn_linear_ok`` says
    no for its dtype (then keep ``F.linear``)."""
    if weight.device.type != "cpu" or not onednn_linear_ok(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Module):
    """y = x W^T (+ b), W: [out_features, in_features] (HF layout). After ``pack_for_cpu`` ``weight`` is that
    matrix in oneDNN's layout (an opaque tensor of the same shape, ``is_mkldnn``; only ``onednn_linear`` reads it)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.packed = False

    def pack_for_cpu(self) -> bool:
        """Multiply through oneDNN from now on, the weight kept in its layout only (``onednn_pack``); False (and
        nothing changed) where that is not available."""
        if self.packed:
            return True
        packed = onednn_pack(self.weight)
        if packed is None:
            return False
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed:
            return onednn_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowParallelLinear(Linear):
    """y = all_reduce(x_r W_r^T) + b: ``in_features`` is this rank's share of the input; ``b`` (full, on every rank)
    is added once, after the reduction. With ``tp_size == 1`` this is ``Linear``."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
        tp: TPGroup,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.tp_size == 1:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y.add_(self.bias)


class RMSNorm(nn.Module):
    """HF-exact: normalise in fp32, cast back, then scale by weight. ``fused``: one Triton kernel
    (``common.engine.kernels.fused_layers``) instead of torch's op sequence."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused_layers().rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.eps))
        if x.dtype == torch.float32:
            return x32.mul_(self.weight)  # x32 is a fresh tensor here
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual): the pre-norm of a decoder sublayer over the residual stream.
        Fused, the sum is written into ``residual`` in place; it must not be read elsewhere."""
        if self.fused:
            return fused_layers().rmsnorm(x, self.weight, self.eps, residual=residual), residual
        residual = x + residual
        return self.forward(residual), residual


MLP_BLOCK_BYTES = 8 << 20  # gate|up activations per row block of a long CPU forward (GatedMLP.forward)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up fused as rows [0, I) and [I, 2I) of gate_up_proj.
    ``intermediate`` is this rank's share I (its gate rows | its up rows); down_proj reduces over the group."""

    def __init__(
        self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, dtype, device)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, dtype, device, tp or TPGroup())
        self.fused = False  # silu(gate) * up in one Triton kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]. On CPU a long forward (a prefill) runs in row blocks of at most ``MLP_BLOCK_BYTES`` of
        gate|up each: rows are independent, and the blocks' intermediates stay in cache and in the allocator's
        reused memory instead of fresh pages faulted in by every op (larger blocks are mmapped per allocation)."""
        rows = max(1, MLP_BLOCK_BYTES // (2 * self.intermediate * x.element_size()))
        if x.device.type != "cpu" or x.shape[0] <= rows:
            return self._forward(x)
        out = torch.empty_like(x)
        for s in range(0, x.shape[0], rows):
            out[s : s + rows] = self._forward(x[s : s + rows])
        return out

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(fused_layers().silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
