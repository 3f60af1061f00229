"""``FastTokenizer``: a model folder's tokenizer through the ``tokenizers`` library and jinja2 alone, giving what
``transformers.AutoTokenizer`` (v5) gives — token ids, decoded text, special tokens, chat-template text — without
importing transformers or torch (seconds of CPU in every process that tokenizes).

``load_fast_tokenizer`` builds one only where it knows what AutoTokenizer does with the folder:
- ``TokenizersBackend`` (``tokenizer_class`` PreTrainedTokenizerFast/TokenizersBackend): tokenizer.json as is;
  a missing post-processor is a no-op template (tokenizer_config's add_bos/eos_token are ignored when
  tokenizer.json exists);
- ``Qwen2Tokenizer`` (model_type qwen2, or ``tokenizer_class`` Qwen2Tokenizer, or qwen3 without a class): the
  vocab and merges of tokenizer.json under Qwen2's fixed NFC normalizer, split regex and byte-level decoder.
Anything else (another tokenizer class, remote code, special tokens that tokenizer.json lacks, Mistral's tekken
files or large Mistral vocabularies) answers None, and the caller loads transformers. tests/text/test_fast_tokenizer.py compares both.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from common.text import chat_template

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_DEFAULTS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}


class FastTokenizer:
    """The subset of transformers' tokenizer API that pdcluster uses, with the same results."""

    def __init__(self, backend: Tokenizer, specials: dict[str, str], templates: str | dict[str, str] | None,
                 path: Path) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = specials  # named special tokens: the chat template's variables
        self.chat_template = templates
        self.path = path
        self._hf: Any = None
        self.token_texts: dict[bool, Callable[[int], str]] = {}  # the detokenizer's memo (``token_text``)
        for name in NAMED_SPECIAL_TOKENS:
            token = specials.get(name)
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else backend.token_to_id(token))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend_tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: the batch call without offsets: the same ids, less work (nothing here reads offsets).
        return self.backend_tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int] | int, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode([ids] if isinstance(ids, int) else ids,
                                             skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                            tokenize: bool = True, add_generation_prompt: bool = False, **kwargs: Any) -> Any:
        """``tokenize=False``: the rendered text; ``tokenize=True``: its ids (no special tokens added)."""
        if self.chat_template is None:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        source = chat_template.pick_template(self.chat_template, tools)
        text = chat_template.render(source, messages, tools, add_generation_prompt,
                                    {**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def transformers_tokenizer(self) -> Any:
        """The same tokenizer as transformers builds it, loaded on first use (xgrammar's TokenizerInfo reads one)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        return self._hf


def load_fast_tokenizer(path: Path) -> FastTokenizer | None:
    """The folder's tokenizer without transformers, or None where AutoTokenizer's result is not known here."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    tok_config = _read_json(path / "tokenizer_config.json")
    model_config = _read_json(path / "config.json")
    if tok_config.get("auto_map") or (path / "tekken.json").exists():
        return None
    kind = _tokenizer_kind(tok_config, model_config)
    if kind is None:
        return None
    spec = json.loads(file.read_text(encoding="utf-8"))
    if kind == "qwen2":
        if (spec.get("model") or {}).get("type") != "BPE":
            return None
        spec["model"].update(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                             fuse_unk=False, byte_fallback=False)
        spec["normalizer"] = {"type": "NFC"}
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": bool(tok_config.get("add_prefix_space") or False),
             "trim_offsets": True, "use_regex": False},
        ]}
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.no_truncation()
    backend.no_padding()
    if model_config.get("model_type") == "mistral" and backend.get_vocab_size() > 100_000:
        return None  # transformers may patch the split regex of these (TokenizersBackend._patch_mistral_regex)
    specials = _special_tokens(path, tok_config, QWEN2_DEFAULTS if kind == "qwen2" else {})
    if specials is None or not _tokens_present(backend, tok_config, specials):
        return None
    if tok_config.get("clean_up_tokenization_spaces") and (spec.get("model") or {}).get("type") != "BPE":
        return None  # transformers cleans decoded text up for WordPiece-like models
    return FastTokenizer(backend, specials, _chat_templates(path, tok_config), path)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    data = json.loads(file.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _tokenizer_kind(tok_config: dict[str, Any], model_config: dict[str, Any]) -> str | None:
    """Which transformers class AutoTokenizer (v5) builds: "plain" (TokenizersBackend), "qwen2", or None."""
    declared = tok_config.get("tokenizer_class") or model_config.get("tokenizer_class")
    declared = declared.removesuffix("Fast") if isinstance(declared, str) else None
    model_type = model_config.get("model_type")
    if model_type == "qwen2" or declared == "Qwen2Tokenizer" or (model_type == "qwen3" and declared is None):
        return "qwen2"
    if declared in ("PreTrainedTokenizer", "TokenizersBackend"):
        return "plain"
    return None


def _content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(path: Path, tok_config: dict[str, Any], defaults: dict[str, str]) -> dict[str, str] | None:
    """Named special tokens as transformers reads them (tokenizer_config.json, else the legacy
    special_tokens_map.json), or None when the config names extra ``*_token`` keys this reader does not map."""
    source = dict(tok_config)
    if "added_tokens_decoder" not in tok_config:
        source.update(_read_json(path / "special_tokens_map.json"))
    specials: dict[str, str] = {}
    for name in NAMED_SPECIAL_TOKENS:
        value = _content(source[name]) if name in source else defaults.get(name)
        if value is not None:
            specials[name] = value
    if any(k.endswith("_token") and k not in NAMED_SPECIAL_TOKENS and isinstance(v, (str, dict))
           for k, v in source.items()):
        return None  # model-specific tokens join the template variables in transformers: not mapped here
    return specials


def _tokens_present(backend: Tokenizer, tok_config: dict[str, Any], specials: dict[str, str]) -> bool:
    """Every token the config names is already a special added token of tokenizer.json (transformers would add
    the missing ones, with ids this reader does not assign)."""
    added = {t.content: (i, t.special) for i, t in backend.get_added_tokens_decoder().items()}
    extra = tok_config.get("extra_special_tokens") or tok_config.get("additional_special_tokens") or []
    if not isinstance(extra, list):
        return False
    named = [*specials.values(), *(c for c in map(_content, extra))]
    if any(t is None or t not in added or not added[t][1] for t in named):
        return False
    for index, token in (tok_config.get("added_tokens_decoder") or {}).items():
        content = _content(token)
        if added.get(content or "") != (int(index), bool(token.get("special", False))):
            return False
    return True


def _chat_templates(path: Path, tok_config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja (and additional_chat_templates/*.jinja) over tokenizer_config.json's, as transformers
    loads them."""
    templates: dict[str, str] = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    for extra in sorted((path / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = tok_config.get("chat_template")
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value}
    return value if isinstance(value, str) else None
