"""config.json read with ``json``, giving the attributes ``transformers.AutoConfig`` gives, for the supported
model types only: a node's front reads its model's config without importing torch or transformers (seconds of CPU
per process start).

``read_config`` answers None whenever its reading could differ from transformers' (a model type it does not know,
a field it would have to default that has no fixed default here, legacy ``rope_scaling``): the caller then asks
``AutoConfig``. The defaults below are the transformers config classes' (tests/engine/test_hf_config.py compares).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from common.errors import ModelLoadError

# Fields read without a default: a config.json that lacks one goes through AutoConfig.
REQUIRED = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
    "max_position_embeddings", "rms_norm_eps",
)
_COMMON = {"hidden_act": "silu", "tie_word_embeddings": False, "num_key_value_heads": None, "head_dim": None}
# model_type -> (its architecture, the defaults of its transformers config class for the fields ModelConfig reads)
MODEL_TYPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {
        **_COMMON, "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    }),
    "mistral": ("MistralForCausalLM", {
        **_COMMON, "num_key_value_heads": 8, "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2,
    }),
    "qwen2": ("Qwen2ForCausalLM", {
        **_COMMON, "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "layer_types": None, "bos_token_id": None, "eos_token_id": None,
    }),
    "qwen3": ("Qwen3ForCausalLM", {
        **_COMMON, "num_key_value_heads": 32, "head_dim": 128, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": 4096, "max_window_layers": 28, "layer_types": None, "bos_token_id": None,
        "eos_token_id": None,
    }),
}


def read_config(path: Path) -> SimpleNamespace | None:
    """The attributes of ``AutoConfig.from_pretrained(path)`` that ModelConfig reads, or None (ask AutoConfig)."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file}: cannot be read ({e})") from e
    if not isinstance(raw, dict) or raw.get("model_type") not in MODEL_TYPES:
        return None
    arch, defaults = MODEL_TYPES[raw["model_type"]]
    if raw.get("architectures") != [arch] or any(raw.get(k) is None for k in REQUIRED):
        return None
    rope = _rope_parameters(raw)
    if rope is None or (raw["model_type"] == "mistral" and "layer_types" in raw):
        return None
    cfg = {**defaults, **{k: v for k, v in raw.items() if k in defaults or k in REQUIRED}}
    cfg["architectures"] = [arch]
    cfg["rope_parameters"] = rope
    cfg["dtype"] = raw.get("dtype") or raw.get("torch_dtype")
    if cfg["num_key_value_heads"] is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if cfg["head_dim"] is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if "use_sliding_window" in defaults:  # Qwen2Config/Qwen3Config.__post_init__
        if not cfg["use_sliding_window"]:
            cfg["sliding_window"] = None
        if cfg["layer_types"] is None:
            cfg["layer_types"] = [
                "sliding_attention" if cfg["sliding_window"] is not None and i >= cfg["max_window_layers"]
                else "full_attention"
                for i in range(cfg["num_hidden_layers"])
            ]
    return SimpleNamespace(**cfg)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any] | None:
    """transformers v5's ``rope_parameters``, where reading it needs no conversion; else None."""
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp and raw.get("rope_scaling") is None:
        return dict(rp)
    if rp is None and raw.get("rope_scaling") is None and raw.get("rope_theta") is not None:
        return {"rope_type": "default", "rope_theta": raw["rope_theta"]}
    return None
