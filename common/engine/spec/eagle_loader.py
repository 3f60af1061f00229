"""Load an EAGLE / EAGLE-3 draft head from a local folder in the public checkpoint layouts.

    EAGLE  (yuhuili/EAGLE-LLaMA3-Instruct-8B):   fc.weight [H, 2H], fc.bias, layers.0.self_attn.{q,k,v,o}_proj.weight,
                                                 layers.0.mlp.{gate,up,down}_proj.weight,
                                                 layers.0.post_attention_layernorm.weight
    EAGLE3 (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): fc.weight [H, 3H], midlayer.self_attn.{q,k,v}_proj.weight [*, 2H],
                                                 midlayer.self_attn.o_proj.weight, midlayer.mlp.*,
                                                 midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
                                                 norm.weight, lm_head.weight [draft_vocab, H], d2t [draft_vocab], t2d

Names may carry a ``model.`` prefix. Weights come from ``*.safetensors`` or, failing those, ``pytorch_model.bin``
(read with ``weights_only``). Not read: ``embed_tokens.weight`` (the target's embedding is used), EAGLE's
``lm_head.weight`` (the target's head is used), a layer-0 ``input_layernorm.weight`` (EAGLE's first layer has none),
``t2d`` (the inverse of ``d2t``).

Under tensor parallelism the layer's sharded weights (q/k/v and gate/up rows, o_proj and down_proj columns) are
narrowed to this rank's part as the target's loader narrows them (``shard_plan``); the rest is read whole.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from common.engine.model.config import safetensors_files
from common.engine.model.llama import LlamaForCausalLM
from common.engine.model.loader import shard_plan
from common.engine.spec.eagle_model import EAGLE, EAGLE3, EagleConfig, EagleHead
from common.errors import ModelLoadError

_FUSED = {
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}
_NOT_READ = ("embed_tokens.weight", "t2d", "rotary_emb.inv_freq")
_NOT_READ_EAGLE = ("lm_head.weight", "layers.0.input_layernorm.weight")


def read_head_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's checkpoint by name (``model.`` prefix dropped), on the CPU."""
    if not path.is_dir():
        raise ModelLoadError(f"draft head path {path} is not a directory; pass a local EAGLE checkpoint folder")
    weights: dict[str, torch.Tensor] = {}
    files = safetensors_files(path)
    if files:
        for file in files:
            weights.update(load_file(str(file), device="cpu"))
    elif (path / "pytorch_model.bin").is_file():
        try:
            weights = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except (RuntimeError, OSError, ValueError) as e:
            raise ModelLoadError(f"{path / 'pytorch_model.bin'}: cannot be read ({e})") from e
    else:
        raise ModelLoadError(f"{path} has no *.safetensors or pytorch_model.bin weights")
    return {name.removeprefix("model."): t for name, t in weights.items()}


def load_eagle_head(
    path: str | Path, algorithm: str, target: LlamaForCausalLM, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> EagleHead:
    """The head at ``path`` for ``target``, every parameter filled (cast to ``dtype``). Raises ``ModelLoadError``
    naming the file and the weight when the folder does not hold a head of ``algorithm`` for this target."""
    path = Path(path)
    weights = read_head_weights(path)
    layout = EAGLE3 if any(n.startswith("midlayer.") for n in weights) else EAGLE
    if layout != algorithm:
        raise ModelLoadError(
            f"{path} holds an {layout} head ({'midlayer' if layout == EAGLE3 else 'layers.0'}.* weights), not an "
            f"{algorithm} one; pass --speculative-algorithm {layout}"
        )
    cfg = EagleConfig.from_path(path, algorithm, target.config, set(weights))
    head = EagleHead(cfg, target, dtype, device)
    params = dict(head.named_parameters())
    layer_prefix = "layers.0." if algorithm == EAGLE else "midlayer."
    filled: dict[str, int] = {}
    for name, w in weights.items():
        if name.endswith(_NOT_READ) or (algorithm == EAGLE and name in _NOT_READ_EAGLE):
            continue
        if name == "d2t":
            if algorithm == EAGLE or w.shape != (cfg.draft_vocab_size,):
                raise ModelLoadError(f"{path}: d2t of shape {tuple(w.shape)}, expected ({cfg.draft_vocab_size},) "
                                     "for an EAGLE3 head with its own draft vocab")
            head.hot_token_ids = (w.to(torch.int64) + torch.arange(w.shape[0])).to(head.device)
            continue
        ours = "layer." + name.removeprefix(layer_prefix) if name.startswith(layer_prefix) else name
        shard = None
        for frag, (fused, index) in _FUSED.items():
            if frag in ours:
                ours, shard = ours.replace(frag, fused), index
        if ours not in params:
            raise ModelLoadError(f"{path}: unexpected weight {name!r} for an {algorithm} head")
        _copy(head, ours, params[ours], w, shard, path, name)
        filled[ours] = filled.get(ours, 0) + 1
    missing = [n for n, p in params.items() if filled.get(n, 0) != _num_shards(n)]
    if missing:
        raise ModelLoadError(f"{path}: weights missing or incomplete for {', '.join(missing[:5])}")
    if cfg.draft_vocab_size != target.config.vocab_size and head.hot_token_ids is None:
        raise ModelLoadError(f"{path}: lm_head has {cfg.draft_vocab_size} rows (a draft vocab) but no d2t mapping")
    if head.hot_token_ids is not None and int(head.hot_token_ids.max()) >= target.config.vocab_size:
        raise ModelLoadError(f"{path}: d2t maps a draft token past the target's vocab {target.config.vocab_size}")
    return head.eval()


def _num_shards(name: str) -> int:
    return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1


def _copy(head: EagleHead, ours: str, param: torch.Tensor, w: torch.Tensor, shard: int | None, path: Path,
          name: str) -> None:
    """Checkpoint tensor ``name`` (rows ``shard`` of the fused ``ours``) into this rank's ``param``."""
    if ours.startswith("layer."):  # the decoder layer: this rank's part, as the target's layers are split
        full, dim, part, dst = shard_plan(ours, param, shard, head.config.layer, head.shard)
    else:
        full, dim, part, dst = tuple(param.shape), None, range(0), param
    if tuple(w.shape) != full:
        raise ModelLoadError(f"{path}: {name} has shape {tuple(w.shape)}, config.json implies {full}")
    if dim is not None:
        w = w.narrow(dim, part.start, len(part))
    with torch.no_grad():
        dst.copy_(w)
