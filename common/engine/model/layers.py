"""Building blocks of Llama-family decoders. Parameters are allocated uninitialised: the loader fills them all.

Tensor parallelism: a column-parallel layer is a plain ``Linear`` over this rank's output rows (the loader reads
those rows); ``RowParallelLinear`` holds this rank's input columns and sums the partial outputs over the group.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.distributed import TPGroup


@functools.cache
def fused_layers() -> ModuleType:
    """The Triton kernels module, imported on first use (Triton is not imported on the torch path)."""
    from common.engine.kernels import fused_layers as module

    return module


class Linear(nn.Module):
    """y = x W^T (+ b), W: [out_features, in_features] (HF layout)."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
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
