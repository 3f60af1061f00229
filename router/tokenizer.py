"""``Tokenizer``: the HF tokenizer with a fast path into the Rust tokenizer (and its caches,
router/tokenize_cache.py), plus the byte bound of its tokens.

Imported by the router and by its tokenize worker processes (router/tokenize_worker.py), so it imports no gRPC.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

from common.errors import ConfigError, InvalidRequestError
from router.tokenize_cache import TokenizerCache


class Tokenizer:
    """The HF tokenizer, with a fast path straight into the Rust tokenizer when it encodes identically (its
    offset-free batch encode: nothing here reads offsets)."""

    def __init__(self, hf: Any, l0_max_entries: int = 0, l1_max_bytes: int = 0) -> None:
        """``l0_max_entries`` / ``l1_max_bytes``: the ``TokenizerCache`` levels (0: off)."""
        self.hf = hf
        self.vocab_size = len(hf)
        self.has_chat_template = bool(getattr(hf, "chat_template", None))
        backend = getattr(hf, "backend_tokenizer", None)
        probe = "Hello, world! 12 \u00e9t\u00e9 \U0001f600\n  x"
        self._fast = (
            backend if backend is not None
            and backend.encode_batch_fast([probe])[0].ids == backend.encode(probe).ids == hf.encode(probe)
            else None
        )
        self.cache: TokenizerCache | None = None
        if l0_max_entries or l1_max_bytes:
            if self._fast is None:
                raise ConfigError("--tokenizer-cache-enable-l0 / -l1 need the model's tokenizer.json read by the "
                                  "Rust tokenizer (this model's tokenizer is not); drop the flags")
            self.cache = TokenizerCache(self._fast, l0_max_entries, l1_max_bytes)
        ids = [*hf.encode(probe), *range(min(self.vocab_size, 64))]
        same = backend is not None and all(
            backend.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
            for skip in (True, False)
        )
        self._fast_decode = backend if same else None
        self.token_texts: dict[bool, Callable[[int], str]] = {}  # the detokenizer's memo (``token_text``)

    def decode_fn(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """``decode`` with the flag bound: the Rust tokenizer's own method when it decodes the same (no Python frame
        per call: the incremental detokenizer calls it twice per streamed token)."""
        if self._fast_decode is not None:
            return partial(self._fast_decode.decode, skip_special_tokens=skip_special_tokens)
        return partial(self.hf.decode, skip_special_tokens=skip_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Same text as the HF tokenizer's ``decode`` (used by the incremental detokenizer on the hot path)."""
        if self._fast_decode is not None:
            return self._fast_decode.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        if self.cache is not None:
            return self.cache.encode(text, True)
        if self._fast is not None:
            return self._fast.encode_batch_fast([text])[0].ids
        return self.hf.encode(text)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        try:
            text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except (
            Exception
        ) as e:  # jinja raises anything (TemplateError, TypeError) on input the template rejects
            raise InvalidRequestError(f"messages: the model's chat template rejected them: {e}") from e
        if self.cache is not None:
            return self.cache.encode(text, False)
        if self._fast is not None:
            return self._fast.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self.hf.encode(text, add_special_tokens=False)

    def max_bytes_per_token(self) -> int | None:
        """An upper bound on the prompt bytes one token can stand for, or None when this tokenizer has none.

        Sound for BPE vocabularies whose token strings are the text they cover under transforms that never shrink
        it (ByteLevel: 1 byte -> 1 char of 1-2 bytes; Metaspace: " " -> "\u2581"; byte fallback "<0x41>"): the
        longest token's UTF-8 length. A normalizer (NFC/NFKC composition merges up to 3 code points into one)
        multiplies it by 4. A fused unknown token, WordPiece/Unigram models and pre-tokenizers that drop text can
        stand for any number of bytes: None (no early byte bound).
        """
        if self._fast is None:
            return None
        spec = json.loads(self._fast.to_str())
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            return None
        if model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback"):
            return None
        if _drops_text(spec.get("pre_tokenizer")):
            return None
        vocab = self._fast.get_vocab(with_added_tokens=True)
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
        return longest * (NORMALIZER_SHRINK if spec.get("normalizer") else 1)


NORMALIZER_SHRINK = 4  # > the 3:1 worst case of Unicode composition (Hangul jamo -> one syllable)
_DROPPING_PRE_TOKENIZERS = frozenset({"Whitespace", "WhitespaceSplit", "BertPreTokenizer"})


def _drops_text(pre: dict[str, Any] | None) -> bool:
    """True when a pre-tokenizer (or one in a Sequence) removes input text instead of splitting it."""
    if not pre:
        return False
    if pre.get("type") == "Sequence":
        return any(_drops_text(p) for p in pre.get("pretokenizers", ()))
    return pre.get("type") in _DROPPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed"
