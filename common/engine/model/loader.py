"""Load a local HF model folder into ``LlamaForCausalLM`` (safetensors only, by HF weight names), or with
``load_format="dummy"`` fill it with seeded random weights from config.json alone (``dummy_weights``).

With tensor parallelism each rank reads only its slices of a sharded weight (``safe_open(...).get_slice``), never
the whole tensor; replicated weights (embedding, norms, row-parallel biases) are read whole. The layout of a shard
is ``ShardLayout`` (``common.engine.model.parallel``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from common.engine.distributed import TPGroup
from common.engine.model.config import ModelConfig, safetensors_files
from common.engine.model.dummy_weights import fill_dummy_
from common.engine.model.llama import LlamaForCausalLM
from common.engine.model.parallel import ShardLayout
from common.errors import ModelLoadError

# HF name fragment -> (our fused param fragment, shard index). Shard order is the row order of the fused weight.
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp: TPGroup | None = None,
    load_format: str = "auto",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model (this rank's shard of it under ``tp``) for ``path`` and fill every parameter from its
    safetensors files (cast to ``dtype``); ``load_format="dummy"``: from ``dummy_weights`` instead (no file read)."""
    cfg = ModelConfig.from_path(path, load_format)
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device, tp=tp)
    if load_format == "dummy":
        fill_dummy_model(model, cfg)
        return model.eval(), cfg
    params = dict(model.named_parameters())
    # A TP rank of a tied model has its own LM head shard, read from the embedding's rows.
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in params
    filled: dict[str, int] = {}  # param name -> number of shards written
    for file in safetensors_files(cfg.path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if hf_name.endswith(_IGNORED_SUFFIXES):
                    continue
                if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                name, shard = _our_name(hf_name)
                if name not in params:
                    raise ModelLoadError(f"{file}: unexpected weight {hf_name!r} for {cfg.architecture}")
                targets = [name, "lm_head.weight"] if tied_head and name == "model.embed_tokens.weight" else [name]
                for target in targets:
                    _read_into(f, hf_name, target, params[target], shard, cfg, model.shard, file)
                    filled[target] = filled.get(target, 0) + 1
    missing = [n for n in params if filled.get(n, 0) != _num_shards(n)]
    if missing:
        raise ModelLoadError(f"{cfg.path}: weights missing or incomplete for {', '.join(missing[:5])}")
    return model.eval(), cfg


def fill_dummy_model(model: LlamaForCausalLM, cfg: ModelConfig) -> None:
    """Every parameter of this rank's shard from ``dummy_weights``: each HF weight it holds a part of (the q/k/v and
    gate/up rows of the fused ones), sliced as the checkpoint loader slices it."""
    tied = cfg.tie_word_embeddings
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and tied:  # a TP rank's head shard: rows of the embedding
            parts: list[tuple[str, int | None]] = [("model.embed_tokens.weight", None)]
        else:
            fused = [(name.replace(ours, frag), shard) for frag, (ours, shard) in _FUSED.items() if ours in name]
            parts = fused or [(name, None)]
        for hf_name, shard in parts:
            full, dim, part, dst = shard_plan(name, param, shard, cfg, model.shard)
            fill_dummy_(dst, hf_name, full, dim, part, cfg.hidden_size, tied)


def _our_name(hf_name: str) -> tuple[str, int | None]:
    name = hf_name
    for frag, (fused, shard) in _FUSED.items():
        if frag in name:
            return name.replace(frag, fused), shard
    return name, None


def _num_shards(name: str) -> int:
    if ".qkv_proj." in name:
        return 3
    return 2 if ".gate_up_proj." in name else 1


def shard_plan(
    name: str, param: torch.Tensor, shard: int | None, cfg: ModelConfig, layout: ShardLayout
) -> tuple[tuple[int, ...], int | None, range, torch.Tensor]:
    """(HF shape config.json implies, sharded dim of the HF tensor or None, this rank's range along it, the
    destination view of ``param``)."""
    d, rest = cfg.head_dim, tuple(param.shape[1:])
    if ".qkv_proj." in name:
        assert shard is not None
        local = [layout.num_heads * d, layout.num_kv_heads * d, layout.num_kv_heads * d]
        dst = param.narrow(0, sum(local[:shard]), local[shard])
        heads, total = (layout.q_heads, cfg.num_heads) if shard == 0 else (layout.kv_heads, cfg.num_kv_heads)
        return (total * d, *rest), 0, range(heads.start * d, heads.stop * d), dst
    if ".gate_up_proj." in name:
        assert shard is not None
        n = layout.intermediate
        return (cfg.intermediate_size, *rest), 0, range(layout.tp_rank * n, (layout.tp_rank + 1) * n), \
            param.narrow(0, shard * n, n)
    if name.endswith(".o_proj.weight"):
        q = layout.q_heads
        return (cfg.hidden_size, cfg.num_heads * d), 1, range(q.start * d, q.stop * d), param
    if name.endswith(".down_proj.weight"):
        n = layout.intermediate
        return (cfg.hidden_size, cfg.intermediate_size), 1, range(layout.tp_rank * n, (layout.tp_rank + 1) * n), param
    if name == "lm_head.weight":
        rows = layout.vocab_rows
        with torch.no_grad():
            param[len(rows):].zero_()  # vocab padding: zero logits, sliced off after the gather
        return (cfg.vocab_size, *rest), 0, rows, param.narrow(0, 0, len(rows))
    return tuple(param.shape), None, range(0), param


def _read_into(
    f: Any,
    hf_name: str,
    name: str,
    param: torch.Tensor,
    shard: int | None,
    cfg: ModelConfig,
    layout: ShardLayout,
    file: Path,
) -> None:
    """Copy this rank's part of HF tensor ``hf_name`` into ``param`` (our ``name``), or into rows ``shard`` of a
    fused param; reads only that part."""
    full, dim, part, dst = shard_plan(name, param, shard, cfg, layout)
    sl = f.get_slice(hf_name)
    shape = tuple(sl.get_shape())
    if shape != full:
        raise ModelLoadError(f"{file}: {hf_name} has shape {shape}, config.json implies {full}")
    if dim is None or (part.start == 0 and part.stop == full[dim]):
        w = f.get_tensor(hf_name)
    elif dim == 0:
        w = sl[part.start:part.stop]
    else:
        w = sl[:, part.start:part.stop]
    assert tuple(w.shape) == tuple(dst.shape), (hf_name, tuple(w.shape), tuple(dst.shape))
    with torch.no_grad():
        dst.copy_(w)
