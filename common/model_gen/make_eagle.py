"""Generate a seeded random EAGLE / EAGLE-3 draft head for a (generated or real) Llama-family target folder, in the
public checkpoint layouts ``common.engine.spec.eagle_loader`` reads (config.json + model.safetensors, no tokenizer:
a head uses its target's).

EAGLE3 heads get a draft vocab of about two thirds of the target's (a seeded subset of target ids, ``d2t`` / ``t2d``
as the EAGLE-3 repository writes them) and read the target layers named in ``eagle_config``. Same (target, kind,
seed) -> byte-identical files within one environment.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

KINDS = ("EAGLE", "EAGLE3")


def make_eagle_head(target_dir: Path, out_dir: Path, kind: str, seed: int = 0) -> Path:
    """Write a random ``kind`` head for the model at ``target_dir`` into ``out_dir`` (created) and return it."""
    if kind not in KINDS:
        raise ValueError(f"unknown draft head kind {kind!r}; choose one of {', '.join(KINDS)}")
    try:
        t = json.loads((Path(target_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{target_dir}: no readable config.json ({e}); pass the target model's folder") from e
    hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    kv_heads, vocab = int(t.get("num_key_value_heads") or heads), int(t["vocab_size"])
    head_dim = int(t.get("head_dim") or hidden // heads)
    layers = int(t["num_hidden_layers"])
    config: dict = {
        "architectures": ["LlamaForCausalLM" if kind == "EAGLE" else "LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(t["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(t["max_position_embeddings"]),
        "vocab_size": vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    rope = t.get("rope_scaling") or t.get("rope_parameters")
    if rope:
        config["rope_scaling"] = rope
    config["rope_theta"] = float(t.get("rope_theta") or (rope or {}).get("rope_theta", 10000.0))
    gen = torch.Generator().manual_seed(seed)
    q, kv, inter = heads * head_dim, kv_heads * head_dim, config["intermediate_size"]
    attn_in = hidden if kind == "EAGLE" else 2 * hidden
    prefix = "layers.0." if kind == "EAGLE" else "midlayer."
    shapes = {
        f"{prefix}self_attn.q_proj.weight": (q, attn_in),
        f"{prefix}self_attn.k_proj.weight": (kv, attn_in),
        f"{prefix}self_attn.v_proj.weight": (kv, attn_in),
        f"{prefix}self_attn.o_proj.weight": (hidden, q),
        f"{prefix}mlp.gate_proj.weight": (inter, hidden),
        f"{prefix}mlp.up_proj.weight": (inter, hidden),
        f"{prefix}mlp.down_proj.weight": (hidden, inter),
        f"{prefix}post_attention_layernorm.weight": (hidden,),
    }
    if kind == "EAGLE":
        config["bias"] = True
        shapes |= {"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,)}
    else:
        draft_vocab = max(2, (2 * vocab) // 3)
        config["draft_vocab_size"] = draft_vocab
        config["target_hidden_size"] = hidden
        # low, mid, high: the outputs of the first, a middle and the last layer (-1: the embedding)
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]}
        shapes |= {
            "fc.weight": (hidden, 3 * hidden),
            f"{prefix}input_layernorm.weight": (hidden,),
            f"{prefix}hidden_norm.weight": (hidden,),
            "norm.weight": (hidden,),
            "lm_head.weight": (draft_vocab, hidden),
        }
    weights = {name: _init(name, shape, gen) for name, shape in sorted(shapes.items())}
    if kind == "EAGLE3":
        hot = torch.randperm(vocab, generator=gen)[: config["draft_vocab_size"]].sort().values
        weights["d2t"] = hot - torch.arange(len(hot))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot] = True
        weights["t2d"] = t2d
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)
    return out_dir


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norms non-unit and the bias nonzero, so a loader that drops one fails the reference comparison."""
    if name.endswith("norm.weight"):
        return (0.8 + 0.4 * torch.rand(shape, generator=gen)).contiguous()
    if name.endswith(".bias"):
        return (0.1 * torch.randn(shape, generator=gen)).contiguous()
    if name == "lm_head.weight":
        return ((4.0 / math.sqrt(shape[1])) * torch.randn(shape, generator=gen)).contiguous()
    return (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).contiguous()
