"""Offline generator for random-weight models in real Hugging Face format (see ``make_model``)."""

from common.model_gen.make_model import ARCHS, SIZES, default_model_path, make_model

__all__ = ["ARCHS", "SIZES", "default_model_path", "make_model"]
