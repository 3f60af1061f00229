"""Load a local HF model folder into ``LlamaForCausalLM`` (safetensors only, by HF weight names)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from common.errors import ModelLoadError
from common.model.config import ModelConfig, safetensors_files
from common.model.llama import LlamaForCausalLM

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
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for ``path`` and fill every parameter from its safetensors files (cast to ``dtype``)."""
    cfg = ModelConfig.from_path(path)
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device)
    params = dict(model.named_parameters())
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
                _copy_shard(name, params[name], f.get_tensor(hf_name), shard, cfg, hf_name, file)
                filled[name] = filled.get(name, 0) + 1
    missing = [n for n in params if filled.get(n, 0) != _num_shards(n)]
    if missing:
        raise ModelLoadError(f"{cfg.path}: weights missing or incomplete for {', '.join(missing[:5])}")
    return model.eval(), cfg


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


def _copy_shard(
    name: str,
    param: torch.Tensor,
    w: torch.Tensor,
    shard: int | None,
    cfg: ModelConfig,
    hf_name: str,
    file: Path,
) -> None:
    """Copy HF tensor ``w`` into ``param`` (our ``name``), or into rows ``shard`` of a fused param."""
    if shard is None:
        dst = param
    else:
        if ".qkv_proj." in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            sizes = [q, kv, kv]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        dst = param.narrow(0, sum(sizes[:shard]), sizes[shard])
    if tuple(dst.shape) != tuple(w.shape):
        raise ModelLoadError(
            f"{file}: {hf_name} has shape {tuple(w.shape)}, config.json implies {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(w)
