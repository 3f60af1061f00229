"""A copy of a model folder whose attention writes nothing to the residual stream (every ``o_proj`` weight zero).

Each position's logits then depend on its own token only: greedy decoding is a function of the last token, so it
falls into a cycle within a few dozen tokens and, from a prompt that already holds the cycle, repeats spans of its
prompt exactly. That is the copy-heavy workload of speculative decoding's tests and benchmark
(``benchmarks/spec_decode.py``) on random weights: the forward costs what the original model's costs (attention is
computed as before), only its function is degenerate.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


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
            if name.endswith("self_attn.o_proj.weight") or name.endswith("self_attn.o_proj.bias"):
                t.zero_()
        save_file(weights, str(out_dir / f.name), metadata={"format": "pt"})
    return out_dir
