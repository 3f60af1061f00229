"""Tokenizer loading and model-path resolution shared by every process that tokenizes or detokenizes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from common.errors import ModelLoadError
from common.text.fast_tokenizer import load_fast_tokenizer

logger = logging.getLogger(__name__)


def resolve_model_path(model_path: str | None) -> Path:
    """The given folder, or the embedded default model (generated once into the cache dir)."""
    if model_path is None:
        from common.model_gen.make_model import default_model_path

        return default_model_path()
    path = Path(model_path)
    if not path.is_dir():
        raise ModelLoadError(f"--model-path {model_path!r} is not a directory; pass a local Hugging Face model folder")
    return path


def load_tokenizer(model_path: str | Path) -> Any:
    """The folder's tokenizer: a ``FastTokenizer`` (no transformers, no torch) where it gives what transformers
    gives, else transformers' ``AutoTokenizer`` (seconds slower to load; logged)."""
    path = Path(model_path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer.model").exists():
        raise ModelLoadError(f"{path} has no tokenizer.json; the model folder needs its tokenizer files")
    try:
        fast = load_fast_tokenizer(path)
    except Exception as e:  # tokenizers raises a plain Exception on a malformed tokenizer.json; re-raised typed
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from e
    if fast is not None:
        return fast
    logger.warning("%s: loading the tokenizer through transformers (%s); this start pays its import", path,
                "no tokenizer.json: a slow tokenizer" if not (path / "tokenizer.json").exists()
                else "a tokenizer class or special-token layout the tokenizers-only loader does not cover")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from e
