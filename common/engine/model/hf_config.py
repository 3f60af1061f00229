"""config.json read with ``json``, giving the attributes ``transformers.AutoConfig`` gives, for the supported
model types only: a node's front reads its model's config without importing torch or transformers (seconds of CPU
per process start).

``read_config`` answers None whenever its reading could differ from transformers' (a model type it does not know,
a field it would have to default that has no fixed default here, a per-layer RoPE): the caller then asks
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
DEFAULT_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
# transformers' required keys per rope type (original_max_position_embeddings defaults to max_position_embeddings)
REQUIRED_ROPE_KEYS = {"linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor"}}
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
    rope = _rope_parameters(raw, file)
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


def _rope_parameters(raw: dict[str, Any], file: Path) -> dict[str, Any] | None:
    """transformers v5's ``rope_parameters`` (RotaryEmbeddingConfigMixin: legacy ``rope_scaling`` wins, then
    ``rope_theta`` and the type filled in) for one RoPE shared by all layers; None for the forms left to AutoConfig
    (per-layer-type RoPE, top-level partial_rotary_factor or original_max_position_embeddings)."""
    src = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(src, dict) or any(isinstance(v, dict) for v in src.values()):
        return None
    if "partial_rotary_factor" in raw or "original_max_position_embeddings" in raw:
        return None
    rp = dict(src)
    rp.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_THETA))
    rp.setdefault("rope_type", rp.get("type", "default"))
    missing = sorted(REQUIRED_ROPE_KEYS.get(rp["rope_type"], set()) - rp.keys())
    if missing:  # transformers' validate_rope raises too
        raise ModelLoadError(f"{file}: rope_parameters of rope_type {rp['rope_type']!r} lack {', '.join(missing)}")
    return rp if rp["rope_theta"] is not None else None
