"""Hugging Face's model holding the very weights ``--load-format dummy`` gives our engine (``dummy_weights``): the
reference side of a comparison at real shapes, where no checkpoint is written (``make-model --size 8b``)."""

from __future__ import annotations

from pathlib import Path

import torch

from common.engine.model.dummy_weights import fill_dummy_


def fill_hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """Overwrite every parameter of an HF causal LM by its dummy values (by HF name; a tied head is the
    embedding's parameter, filled once)."""
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, param in model.named_parameters():
        fill_dummy_(param.data, name, tuple(param.shape), None, range(0), config.hidden_size, tied)
    return model


def hf_dummy_model(path: str | Path, dtype: torch.dtype, device: str | torch.device,
                   attn_implementation: str | None = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` of the folder's config.json, built on ``device`` in ``dtype`` and filled
    with the dummy weights (no weight file read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    return fill_hf_model(model).eval()
