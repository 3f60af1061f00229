"""A model whose attention writes nothing to the residual stream (every ``o_proj`` weight zero): as a copy of a
model folder (``make_copy_model``), or applied to a model already built (``zero_attention_output_``: weights that
exist in no file, ``--load-format dummy``).

Each position's logits then depend on its own token only: greedy decoding is a function of the last token, so it
falls into a cycle and, from a prompt that already holds the cycle, repeats spans of its prompt exactly. That is the
copy-heavy workload of speculative decoding's tests and benchmark (``benchmarks/spec_decode.py``) on random weights:
the forward costs what the original model's costs (attention is computed as before), only its function is degenerate.
Test and benchmark tooling only: nothing on the serving path calls either.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

O_PROJ = "self_attn.o_proj"


def make_copy_model(src: Path, out_dir: Path) -> Path:
    """Write ``src`` with zeroed attention output projections to ``out_dir`` (created) and return it."""
    src, out_dir = Path(src), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out_dir / f.name)
    for f in src.glob("*.safetensors"):
        weights = load_file(str(f))
        for name, t in weights.items():
            if name.endswith(f"{O_PROJ}.weight") or name.endswith(f"{O_PROJ}.bias"):
                t.zero_()
        save_file(weights, str(out_dir / f.name), metadata={"format": "pt"})
    return out_dir


@torch.no_grad()
def zero_attention_output_(model: nn.Module) -> int:
    """Zero every attention output projection of a built model in place and return how many layers.

    In place, so step runners captured before (CUDA graphs read the weights' memory at replay) serve the zeroed
    model. On a CPU weight packed into oneDNN's layout ``zero_`` leaves some blocks as they were: it is replaced by a
    packed zero matrix (no graphs on CPU hold it). Raises when the model has no such layer, so the copy workload never runs unmodified."""
    from common.engine.model.layers import Linear, onednn_pack

    layers = [m for name, m in model.named_modules() if name.endswith(O_PROJ) and isinstance(m, Linear)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention output projection ({O_PROJ}) to zero")
    for m in layers:
        if m.packed:
            packed = onednn_pack(torch.zeros(m.weight.shape, dtype=m.weight.dtype))
            assert packed is not None  # the weight was packed by the same check
            m.weight = nn.Parameter(packed, requires_grad=False)
        else:
            m.weight.zero_()
        if m.bias is not None:
            m.bias.zero_()
    return len(layers)
