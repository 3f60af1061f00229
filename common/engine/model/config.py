"""What the engine needs to know about a model folder, read once from its config.json.

Supported: Llama (2/3, llama3 RoPE scaling), Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), Mistral (sliding window on
every layer). Any problem with the folder is a ``ModelLoadError`` that names the file and what to fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.engine.model.hf_config import read_config
from common.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass(frozen=True)
class RopeParams:
    theta: float
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    context_len: int  # max_position_embeddings
    rms_norm_eps: float
    rope: RopeParams
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 when attention_bias)
    o_bias: bool  # bias on o_proj (Llama/Qwen3 when attention_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None  # a key is visible iff query_pos - key_pos < sliding_window
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype_name: str  # the checkpoint's declared dtype, as torch names it ("float32", "bfloat16")
    load_format: str = "auto"  # auto: the folder's safetensors; dummy: seeded random weights (dummy_weights.py)

    @property
    def attention_bias(self) -> bool:
        return self.qkv_bias

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @classmethod
    def from_path(cls, path: str | Path, load_format: str = "auto") -> ModelConfig:
        """``load_format`` dummy: the folder needs no weight files (config.json and a tokenizer)."""
        path = Path(path)
        if load_format not in ("auto", "dummy"):
            raise ModelLoadError(f"unknown load format {load_format!r}; use auto or dummy")
        check_model_folder(path, weights=load_format == "auto")
        hf = _load_hf_config(path)
        arch = (getattr(hf, "architectures", None) or [None])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{path / 'config.json'}: architecture {arch!r} is not supported; "
                f"use one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if getattr(hf, "mlp_bias", False):
            raise ModelLoadError(f"{path / 'config.json'}: mlp_bias=true is not supported")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ModelLoadError(
                f"{path / 'config.json'}: hidden_act {hf.hidden_act!r} is not supported (need silu)"
            )
        num_heads = int(hf.num_attention_heads)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            path=path,
            architecture=arch,
            hidden_size=int(hf.hidden_size),
            num_layers=int(hf.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or num_heads),
            head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // num_heads),
            intermediate_size=int(hf.intermediate_size),
            vocab_size=int(hf.vocab_size),
            context_len=int(hf.max_position_embeddings),
            rms_norm_eps=float(hf.rms_norm_eps),
            rope=_rope_params(hf, path),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=not is_qwen2 and attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(hf, path),
            eos_token_ids=_eos_token_ids(hf, path),
            bos_token_id=getattr(hf, "bos_token_id", None),
            dtype_name=_dtype_name(hf),
            load_format=load_format,
        )

    def fingerprint(self) -> dict[str, Any]:
        """What two nodes must agree on to exchange KV: shapes, dtype, and a hash of the weight names+shapes."""
        return {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype_name,
            "weights_sha256": weights_digest(self.path) if self.load_format == "auto" else self._dummy_digest(),
        }

    def _dummy_digest(self) -> str:
        """Dummy weights are a function of the shapes (and the fixed seed): nodes that agree on these hold the same
        weights; never equal to a checkpoint's digest."""
        shapes = {k: v for k, v in self.to_dict().items() if k not in ("path", "load_format")}
        return hashlib.sha256(("dummy:" + json.dumps(shapes, sort_keys=True, default=str)).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        d["dtype"] = d.pop("dtype_name")
        return d


def check_model_folder(path: Path, weights: bool = True) -> None:
    """Raise ModelLoadError unless ``path`` holds config.json, safetensors weights (unless not ``weights``) and a
    tokenizer."""
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory; pass a local Hugging Face model folder")
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} has no config.json; pass a Hugging Face model folder (or run make-model)"
        )
    if weights and not safetensors_files(path):
        raise ModelLoadError(f"{path} has no *.safetensors weights; convert the checkpoint to safetensors (or, for "
                             "a folder of config.json and a tokenizer only, --load-format dummy)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); copy the tokenizer files in"
        )


def safetensors_files(path: Path) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def read_safetensors_header(file: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype/shape/offsets), without reading the data."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelLoadError(f"{file}: truncated safetensors file")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{file}: corrupt safetensors header ({e})") from e
    header.pop("__metadata__", None)
    return header


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(path):
        for name, info in read_safetensors_header(file).items():
            shapes[name] = tuple(info["shape"])
    return shapes


def weights_digest(path: Path) -> str:
    shapes = weight_shapes(path)
    text = "\n".join(f"{name}:{list(shapes[name])}" for name in sorted(shapes))
    return hashlib.sha256(text.encode()).hexdigest()


def _load_hf_config(path: Path) -> Any:
    """config.json's fields as AutoConfig reads them: with ``json`` where that reads the same (hf_config.py)."""
    cfg = read_config(path)
    if cfg is not None:
        return cfg
    logger.warning("%s: reading config.json through transformers' AutoConfig (a model type, field or rope form "
                "the json reader does not cover)", path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: cannot be read by transformers ({e})") from e


def _rope_params(hf: Any, path: Path) -> RopeParams:
    rp = getattr(hf, "rope_parameters", None) or {}
    if "rope_theta" not in rp and "default" not in rp:  # per-layer-type dicts are not supported
        rp = {"rope_theta": getattr(hf, "rope_theta", 10000.0), **rp}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{path / 'config.json'}: rope type {rope_type!r} is not supported; use {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{path / 'config.json'}: partial_rotary_factor != 1 is not supported")
    return RopeParams(
        theta=float(rp["rope_theta"]),
        rope_type=rope_type,
        factor=float(rp.get("factor", 1.0)),
        low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            rp.get("original_max_position_embeddings", hf.max_position_embeddings)
        ),
    )


def _sliding_window(hf: Any, path: Path) -> int | None:
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if window is None:
        return None
    if layer_types is not None and len(set(layer_types)) > 1:
        raise ModelLoadError(f"{path / 'config.json'}: sliding window on only some layers is not supported")
    if layer_types is not None and layer_types[0] != "sliding_attention":
        return None
    return int(window)


def _eos_token_ids(hf: Any, path: Path) -> tuple[int, ...]:
    ids: list[int] = []
    sources: list[Any] = [getattr(hf, "eos_token_id", None)]
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        try:
            sources.append(json.loads(gen_file.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{gen_file}: invalid JSON ({e})") from e
    for src in sources:
        for i in [src] if isinstance(src, int) else (src or []):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


# torch's dtype names that checkpoints declare, by their aliases (torch.float is torch.float32).
_DTYPE_NAMES = {
    "float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16",
    "float64": "float64", "double": "float64",
}


def _dtype_name(hf: Any) -> str:
    """The declared dtype's torch name; float32 when there is none. Only an unusual name imports torch."""
    dt = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if dt is None:
        return "float32"
    name = str(dt).removeprefix("torch.")
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES[name]
    import torch

    resolved = getattr(torch, name, None)
    return str(resolved).removeprefix("torch.") if isinstance(resolved, torch.dtype) else "float32"
