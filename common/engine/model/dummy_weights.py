"""``--load-format dummy`` (SGLang's and vLLM's name): seeded random weights made from config.json alone.

Every element of a weight is a function of (seed, the weight's HF name, its index in the full HF tensor): a 32-bit
integer hash of those, turned into a uniform value in integer and exact float32 steps, so the same element comes out
bit-identical on any device and in any slice of the tensor. Hence:

- a rank fills its TP shard directly on its device (rows or columns of the full tensor, no full tensor made and no
  file read), and the shards of all ranks are slices of the one full weight;
- Hugging Face's model of the same config, filled by ``fill_hf_model`` (``common.model_gen.hf_dummy``), holds the
  very same weights, so outputs compare as with a checkpoint.

Scales by HF name follow ``common.model_gen.make_model``: linears variance preserving (std 1/sqrt(fan_in)), norm
weights in [0.8, 1.2), biases std 0.1, the embedding std 1 (hidden**-0.5 when tied), the LM head std 4/sqrt(hidden);
each as a uniform distribution of that standard deviation.
"""

from __future__ import annotations

import math
import zlib

import torch

DUMMY_SEED = 0  # fixed, as vLLM's and SGLang's: every node and rank of a cluster builds the same weights
_MASK = 0xFFFFFFFF
_CHUNK = 1 << 24  # elements hashed at once (bounds the int64 temporaries on the device)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (hash-prospector's two-multiply form, both constants < 2**31, so every product fits
    an int64 exactly) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK
    return x ^ (x >> 15)


def _uniform(index: torch.Tensor, key: int, wide: bool) -> torch.Tensor:
    """float32 in [-1, 1) for each int64 element index, the same on every device. ``wide``: some index needs more
    than 32 bits (a tensor of over 2**32 elements), so the high word is hashed in too."""
    h = _mix32((index & _MASK) ^ key)
    if wide:
        h = _mix32(h ^ (index >> 32))
    return (h >> 8).to(torch.float32) * (2.0 / (1 << 24)) - 1.0


def weight_std(hf_name: str, full_shape: tuple[int, ...], hidden: int, tied: bool) -> tuple[float, float]:
    """(mean, standard deviation) of the weight's elements."""
    if hf_name.endswith("norm.weight"):
        return 1.0, 0.4 / math.sqrt(12)  # uniform over [0.8, 1.2)
    if hf_name.endswith(".bias"):
        return 0.0, 0.1
    if hf_name == "model.embed_tokens.weight":
        return 0.0, hidden**-0.5 if tied else 1.0
    if hf_name == "lm_head.weight":
        return 0.0, 4.0 / math.sqrt(hidden)
    return 0.0, 1.0 / math.sqrt(full_shape[1])


def fill_dummy_(dst: torch.Tensor, hf_name: str, full_shape: tuple[int, ...], dim: int | None, part: range,
                hidden: int, tied: bool, seed: int = DUMMY_SEED) -> None:
    """Write into ``dst`` the slice ``part`` along ``dim`` (None: the whole tensor) of HF weight ``hf_name`` of
    ``full_shape``, generated on ``dst``'s device in chunks of rows."""
    mean, std = weight_std(hf_name, full_shape, hidden, tied)
    amp = std * math.sqrt(3.0)
    key = zlib.crc32(f"{seed}:{hf_name}".encode()) & _MASK
    rows_total = full_shape[0]
    cols_total = math.prod(full_shape[1:])  # 1 for a vector
    if dim is None:
        rows, cols = range(rows_total), range(cols_total)
    elif dim == 0:
        rows, cols = part, range(cols_total)
    elif dim == 1 and len(full_shape) == 2:
        rows, cols = range(rows_total), part
    else:
        raise ValueError(f"{hf_name}: cannot slice a {len(full_shape)}-d weight along dim {dim}")
    out = dst.view(len(rows), len(cols))
    if tuple(out.shape) != (len(rows), len(cols)):
        raise ValueError(f"{hf_name}: destination {tuple(dst.shape)} is not the slice {len(rows)} x {len(cols)}")
    device = dst.device
    wide = (rows.stop - 1) * cols_total + cols.stop - 1 > _MASK
    col_index = torch.arange(cols.start, cols.stop, dtype=torch.int64, device=device)
    step = max(1, _CHUNK // max(1, len(cols)))
    with torch.no_grad():
        for r0 in range(0, len(rows), step):
            r = torch.arange(rows.start + r0, rows.start + min(len(rows), r0 + step), dtype=torch.int64,
                             device=device)
            index = r[:, None] * cols_total + col_index[None, :]
            values = _uniform(index, key, wide) * amp + mean
            out[r0:r0 + len(r)].copy_(values)
