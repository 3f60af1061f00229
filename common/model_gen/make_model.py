"""Generate a random-weight, seeded, real Hugging Face model folder (no download needed).

Output folder: config.json, generation_config.json, model.safetensors (fp32; bf16 for ``1b``), tokenizer.json,
tokenizer_config.json (ChatML chat template), special_tokens_map.json. Same (arch, size, seed) -> byte-identical
files within one environment. Without weights (``weights=False``; always for ``8b``) the folder has no
model.safetensors: it is loaded with ``--load-format dummy`` (seeded random weights made on the device).

Weights are scaled so that greedy decoding is not a near-tie (checked on a few prompts with HF's own forward).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from common import env
from common.model_gen.tokenizer import EOS, IM_END, write_tokenizer_files

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
MIN_MEDIAN_MARGIN = 0.05  # median top-1 minus top-2 logit over the check prompts; fp32 noise is ~1e-5
CHECK_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "1234 + 5678 = 6912; the answer is",
    "Licensed under the Apache License, Version 2.0",
)


@dataclass(frozen=True)
class SizeSpec:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_pos: int
    dtype: str = "float32"  # of the saved weights (and config.dtype)
    weights: bool = True  # False: config and tokenizer only, for --load-format dummy


SIZES = {
    "tiny": SizeSpec(hidden=128, layers=3, heads=4, kv_heads=2, intermediate=256, vocab=1536, max_pos=2048),
    "small": SizeSpec(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, vocab=8192, max_pos=4096),
    # Llama-3.2-1B-shaped (the same generated tokenizer, so a smaller vocab): ~1.0 B parameters, ~2 GB in bf16.
    "1b": SizeSpec(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=8192, max_pos=131072,
                   dtype="bfloat16"),
    # Llama-3.1-8B-shaped (~8.0 B parameters, 16 GB in bf16): config and tokenizer only (the tokenizer padded with
    # filler tokens to the vocabulary), loaded with --load-format dummy.
    "8b": SizeSpec(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, max_pos=131072,
                   dtype="bfloat16", weights=False),
}


def make_model(arch: str, size: str, out_dir: Path, seed: int = 0, weights: bool | None = None) -> Path:
    """Write a model folder to ``out_dir`` (created; existing files overwritten) and return it. ``weights`` False:
    no model.safetensors (load with ``--load-format dummy``); None: the size's default."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    spec = SIZES[size]
    if weights and not spec.weights:
        raise ValueError(f"size {size} is written without weights (config and tokenizer); load it with "
                         "--load-format dummy")
    weights = spec.weights if weights is None else weights
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_ids = write_tokenizer_files(out_dir, spec.vocab, spec.max_pos)
    config = _hf_config(arch, size, spec, tok_ids)
    config.save_pretrained(out_dir)
    gen_config = {
        "bos_token_id": tok_ids["<s>"],
        "eos_token_id": [tok_ids[EOS], tok_ids[IM_END]],
        "pad_token_id": tok_ids["<pad>"],
        "do_sample": False,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen_config, indent=2, sort_keys=True) + "\n")
    (out_dir / "model.safetensors").unlink(missing_ok=True)  # a config-only folder over an old one
    if not weights:
        return out_dir
    tensors = _init_weights(config, seed)
    tensors = _ensure_margin(config, tensors, out_dir)
    if spec.dtype != "float32":
        tensors = {name: t.to(getattr(torch, spec.dtype)) for name, t in tensors.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)  # safetensors writes 0600; images may run as another user
    return out_dir


def default_model_path(cache_dir: Path | None = None, size: str = "small") -> Path:
    """The default model (llama, ``size``, seed 0) at ``<cache_dir>/models/llama-<size>-s0``, generated on first use.

    ``cache_dir`` defaults to ``common.env.cache_dir()``. Generation writes to a private temp folder and renames
    it into place, so concurrent callers (threads or processes) never see a partial folder.
    """
    final = Path(cache_dir if cache_dir is not None else env.cache_dir()) / "models" / f"llama-{size}-s0"
    if (final / "model.safetensors").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        make_model("llama", size, tmp, seed=0)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").exists():  # lost the race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _hf_config(arch: str, size: str, spec: SizeSpec, tok_ids: dict[str, int]) -> PretrainedConfig:
    common = dict(
        vocab_size=tok_ids["vocab_size"],
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_pos,
        rms_norm_eps=1e-6,
        bos_token_id=tok_ids["<s>"],
        eos_token_id=tok_ids[EOS],
        pad_token_id=tok_ids["<pad>"],
        dtype=spec.dtype,
    )
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": spec.max_pos // 8,
        }
        config: PretrainedConfig = LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
        config.architectures = ["LlamaForCausalLM"]
    elif arch == "qwen2":
        rope = {"rope_type": "default", "rope_theta": 1000000.0}
        config = Qwen2Config(
            **common, rope_parameters=rope, tie_word_embeddings=True, use_sliding_window=False
        )
        config.architectures = ["Qwen2ForCausalLM"]
    elif arch == "qwen3":
        # head_dim deliberately != hidden / heads on tiny, so the explicit head_dim path is exercised.
        head_dim = 48 if size == "tiny" else spec.hidden // spec.heads
        rope = {"rope_type": "default", "rope_theta": 1000000.0}
        config = Qwen3Config(
            **common,
            head_dim=head_dim,
            rope_parameters=rope,
            tie_word_embeddings=False,
            use_sliding_window=False,
        )
        config.architectures = ["Qwen3ForCausalLM"]
    else:
        # tiny: a window shorter than test prompts, so sliding-window masking is exercised.
        window = 48 if size == "tiny" else spec.max_pos
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        config = MistralConfig(
            **common, rope_parameters=rope, sliding_window=window, tie_word_embeddings=False
        )
        config.architectures = ["MistralForCausalLM"]
    return config


def _init_weights(config: PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 weights by HF name. Norm weights are non-unit and biases nonzero so a loader that drops them
    fails the logits comparison."""
    with torch.device("meta"):
        shapes = {
            name: tuple(t.shape) for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()
        }
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            t = 0.8 + 0.4 * torch.rand(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            # Tied: a small input embedding, or each token's own logit dominates and greedy repeats it forever.
            t = (hidden**-0.5 if config.tie_word_embeddings else 1.0) * torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            t = (4.0 / math.sqrt(hidden)) * torch.randn(shape, generator=gen)
        else:  # linear [out, in]: variance preserving so that every layer moves the residual stream
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        weights[name] = t.contiguous()
    return weights


def _ensure_margin(
    config: PretrainedConfig, weights: dict[str, torch.Tensor], out_dir: Path
) -> dict[str, torch.Tensor]:
    """Scale the output embedding up until the median greedy margin clears MIN_MEDIAN_MARGIN."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(out_dir / "tokenizer.json"))
    prompts = [tok(p)["input_ids"] for p in CHECK_PROMPTS]
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    for _ in range(6):
        margin = median_greedy_margin(config, weights, prompts)
        if margin > MIN_MEDIAN_MARGIN:
            return weights
        weights[head] = weights[head] * 2.0
    raise RuntimeError(f"median greedy margin {margin:.4f} stays below {MIN_MEDIAN_MARGIN}")


def median_greedy_margin(
    config: PretrainedConfig, weights: dict[str, torch.Tensor], prompts: list[list[int]]
) -> float:
    """Median over all prompt positions of (top-1 - top-2) logit, computed by HF's reference forward."""
    model = hf_model_from_weights(config, weights)
    margins = []
    with torch.inference_mode():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].float()
            top2 = logits.topk(2, dim=-1).values
            margins.append(top2[:, 0] - top2[:, 1])
    return float(torch.cat(margins).median())


def hf_model_from_weights(config: PretrainedConfig, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"weights missing for {missing[:3]}")
    # Non-persistent buffers (rotary inv_freq) stay on meta after assign; rebuild them on CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()
