"""config.json read with json (``common.engine.model.hf_config``) gives the ``ModelConfig`` that transformers'
AutoConfig gives: on every tiny model, on minimal configs that lean on each model type's defaults, on Qwen's
sliding-window switch, and on the forms the json reader leaves to AutoConfig."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from common.engine.model import config as config_module
from common.engine.model.config import ModelConfig
from common.engine.model.hf_config import read_config
from common.errors import ModelLoadError
from tests.model_fixtures import make_tiny_model

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM"}


def via_auto_config(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelConfig:
    with monkeypatch.context() as m:
        m.setattr(config_module, "read_config", lambda _path: None)
        return ModelConfig.from_path(path)


def with_config(tmp_path: Path, arch: str, cfg: dict[str, Any]) -> Path:
    path = tmp_path / arch
    shutil.copytree(make_tiny_model(arch), path)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").unlink()
    return path


def minimal(arch: str, **extra: Any) -> dict[str, Any]:
    return {"architectures": [ARCHS[arch]], "model_type": arch, "hidden_size": 4096, "num_hidden_layers": 3,
            "num_attention_heads": 64, "intermediate_size": 256, "vocab_size": 1536,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 5e5, **extra}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_read_as_transformers(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model(arch)
    assert read_config(path) is not None
    assert ModelConfig.from_path(path) == via_auto_config(path, monkeypatch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("extra", [
    {},  # every optional field at its model type's default (kv heads: 64, 8 or 32 by model type)
    {"num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
     "bos_token_id": 7, "eos_token_id": [1, 2]},
    {"dtype": "float16", "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
     "rope_theta": None},
    # transformers v4's forms: legacy rope_scaling (with "type"), rope_theta beside it or missing
    {"rope_scaling": {"type": "linear", "factor": 4.0}},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256}},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                      "rope_theta": 2e5}},
])
def test_minimal_configs_read_as_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                              extra: dict[str, Any]) -> None:
    path = with_config(tmp_path, arch, minimal(arch, **extra))
    assert read_config(path) is not None
    assert ModelConfig.from_path(path) == via_auto_config(path, monkeypatch)


@pytest.mark.parametrize("rope", [{"rope_type": "llama3", "factor": 8.0}, {"type": "linear"}])
def test_rope_parameters_transformers_rejects_are_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           rope: dict[str, Any]) -> None:
    path = with_config(tmp_path, "llama", minimal("llama", rope_scaling=rope))
    for read in (ModelConfig.from_path, lambda p: via_auto_config(p, monkeypatch)):
        with pytest.raises(ModelLoadError, match="rope"):
            read(path)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("window_layers", [0, 3])
def test_qwen_sliding_window_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                    window_layers: int) -> None:
    for use in (False, True):
        path = with_config(tmp_path / f"{use}", arch, minimal(
            arch, use_sliding_window=use, sliding_window=64, max_window_layers=window_layers))
        got = ModelConfig.from_path(path)
        assert got == via_auto_config(path, monkeypatch)
        assert got.sliding_window == (64 if use and window_layers == 0 else None)
    path = with_config(tmp_path / "mixed", arch, minimal(arch, use_sliding_window=True, sliding_window=64,
                                                         max_window_layers=1))
    for read in (ModelConfig.from_path, lambda p: via_auto_config(p, monkeypatch)):
        with pytest.raises(ModelLoadError, match="only some layers"):
            read(path)


@pytest.mark.parametrize("cfg", [
    minimal("llama", rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),  # per layer
    minimal("llama", partial_rotary_factor=0.5),
    minimal("llama", hidden_size=None),  # a field with a class default the json reader does not hold
    {**minimal("llama"), "model_type": "gemma"},
])
def test_other_configs_go_through_auto_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              cfg: dict[str, Any]) -> None:
    path = with_config(tmp_path, "llama", {k: v for k, v in cfg.items() if v is not None})
    assert read_config(path) is None
    if cfg["model_type"] == "llama":
        try:
            want: Any = via_auto_config(path, monkeypatch)
        except ModelLoadError as e:
            want = str(e)
        try:
            got: Any = ModelConfig.from_path(path)
        except ModelLoadError as e:
            got = str(e)
        assert got == want
