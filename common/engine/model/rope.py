"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama), with default, linear and llama3 scaling.

cos/sin are computed once per forward from ``positions`` in fp32, as HF computes them (``position * inv_freq``),
then cast to the model dtype.
"""

from __future__ import annotations

import math

import torch

from common.engine.model.config import RopeParams


def inv_frequencies(rope: RopeParams, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope: RopeParams, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(rope, head_dim), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped [num_tokens, 1, head_dim] to broadcast over heads."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_signed_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin`` with the first half of sin negated, the tables ``apply_rotary_signed`` takes."""
        cos, sin = self.cos_sin(positions, dtype)
        half = sin.shape[-1] // 2
        sin[..., :half].neg_()
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` bit for bit, in fewer ops: ``rotate_half(x) * sin == swap_halves(x) * signed_sin`` exactly
    (negation is exact). x: [num_tokens, heads, head_dim], may be a strided view (q and k heads together)."""
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    out = x * cos
    return out.add_(swapped.mul_(signed_sin))
