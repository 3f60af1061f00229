"""``TokenizerCache``: token ids of texts seen before, in front of the Rust tokenizer's encode (sglang-router's
``--tokenizer-cache-enable-l0`` / ``--tokenizer-cache-enable-l1``).

- L0: a whole text -> its ids; LRU by entries; texts up to ``L0_MAX_CHARS`` characters.
- L1: each *piece* of a text -> its ids, where a text is cut just after every occurrence of an isolating added token
  (``<|im_end|>``, ``<|eot_id|>``, ...); LRU by bytes. A chat prompt that repeats a system prompt or a conversation's
  earlier turns encodes only its new pieces.

Why an L1 answer is the uncached encode's. The tokenizers library encodes a text in five steps: (1) split out the
added tokens with ``normalized: false`` (leftmost-longest over all of them, then each token's lstrip / rstrip /
single_word); (2) normalize each remaining piece on its own and split out the normalized added tokens; (3)
pre-tokenize each piece on its own; (4) run the model on each pre-token on its own; (5) put the post-processor's
special tokens around the whole. So the ids of a text are the concatenation of its pieces' ids, each piece encoded
alone, wherever (a) step 1 provably splits at every cut, and (b) steps 2-4 look only at a piece's own characters,
never at where it sat in the text, and (c) step 5 adds the same ids whatever the text. ``isolating_tokens`` keeps
the tokens T that give (a) whatever surrounds them (see there); ``l1_refusal`` checks (b) and (c) on the
tokenizer's pipeline: only steps known to be position-blind are accepted (Metaspace's ``prepend_scheme: first``,
which prepends only at the text's offset 0, is not), and BPE dropout (ids that vary per call) refuses both levels.
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from collections import OrderedDict
from typing import Any

from common import env
from common.errors import ConfigError

L0_MAX_CHARS = 8192  # longer texts are left to L1 (L0 holds at most max_entries of these)
ENTRY_BYTES = 100  # an L1 entry's bookkeeping besides its key and ids (ordered-dict slot and link), an estimate

# Pipeline steps whose output depends only on the characters of the piece they are given (tokenizers' JSON names).
POSITION_BLIND_NORMALIZERS = frozenset({
    "BertNormalizer", "Strip", "StripAccents", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Nmt", "Precompiled",
    "Replace", "Prepend", "ByteLevel",
})
POSITION_BLIND_PRE_TOKENIZERS = frozenset({
    "ByteLevel", "Split", "Punctuation", "Whitespace", "WhitespaceSplit", "BertPreTokenizer", "Digits",
    "UnicodeScripts", "CharDelimiterSplit", "FixedLength",
})
# Post-processors whose added ids do not depend on the text (ByteLevel only trims offsets).
FIXED_POST_PROCESSORS = frozenset({"TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel"})


def _steps(spec: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A pipeline step and the steps of its ``Sequence``s, flattened."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [s for sub in spec.get(key, ()) for s in _steps(sub, key)]
    return [spec]


def encode_refusal(backend: Any) -> str | None:
    """Why no cache may stand in for ``backend.encode`` (its ids vary per call), or None."""
    model = json.loads(backend.to_str()).get("model") or {}
    if model.get("dropout"):
        return "its BPE model has dropout (the ids of a text vary per call)"
    return None


def isolating_tokens(backend: Any) -> tuple[str, ...]:
    """The added tokens T at the end of whose every occurrence the tokenizer's first step splits, whatever the text
    around it, so the rest of the text is encoded as if it began there. With M the added tokens matched on the raw
    text (``normalized: false``), T is in M and:
    - T does not take the characters after it (no rstrip), nor depend on them (no single_word), and does not start
      or end with whitespace, so no lstrip / rstrip of a neighbour reaches across T;
    - no other token of M contains T, and no token of M (T included) ends with a proper prefix of T: the only match
      that can cover an occurrence of T is T itself, so leftmost-longest matching takes every occurrence, and the
      match after it starts its search where T ends, as on a text that starts there;
    - when a token of M has single_word (whose match looks at the character before it), T does not end with a word
      character (the text start counts as a non-word character)."""
    if getattr(backend, "encode_special_tokens", False):
        return ()  # special tokens are encoded as text: no split at them
    raw = [t for t in backend.get_added_tokens_decoder().values() if not t.normalized and t.content]
    contents = [t.content for t in raw]
    any_single_word = any(t.single_word for t in raw)
    out = []
    for t in raw:
        c = t.content
        c_last = c[-1]
        if t.rstrip or t.single_word or c[0].isspace() or c_last.isspace():
            continue
        if any_single_word and (c_last.isalnum() or c_last == "_" or not c_last.isascii()):
            continue
        if any(c in v for v in contents if v != c):
            continue
        if any(v.endswith(c[:k]) and len(v) > k for v in contents for k in range(1, len(c))):
            continue
        out.append(c)
    return tuple(sorted(out, key=len, reverse=True))


def l1_refusal(backend: Any) -> str | None:
    """Why L1 may not cut texts for ``backend`` (steps 2-5 of the module docstring), or None."""
    spec = json.loads(backend.to_str())
    if backend.truncation is not None or backend.padding is not None:
        return "the tokenizer truncates or pads (a piece's ids are not the text's)"
    for step in _steps(spec.get("normalizer"), "normalizers"):
        if step.get("type") not in POSITION_BLIND_NORMALIZERS:
            return f"its normalizer {step.get('type')!r} is not known to look only at a piece's own characters"
    for step in _steps(spec.get("pre_tokenizer"), "pretokenizers"):
        kind = step.get("type")
        if kind == "Metaspace" and step.get("prepend_scheme", "always") in ("always", "never"):
            continue
        if kind not in POSITION_BLIND_PRE_TOKENIZERS:
            detail = " with prepend_scheme first (it prepends only at the text's start)" if kind == "Metaspace" else ""
            return f"its pre-tokenizer {kind!r}{detail} is not known to look only at a piece's own characters"
    for step in _steps(spec.get("post_processor"), "processors"):
        if step.get("type") not in FIXED_POST_PROCESSORS:
            return f"its post-processor {step.get('type')!r} is not known to add the same tokens to every text"
    if not isolating_tokens(backend):
        return ("it has no added token that provably splits the text (an added token with normalized false, no "
                "rstrip / single_word, that no other added token overlaps)")
    return None


def special_ends(backend: Any) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after every text (``add_special_tokens=True``)."""
    enc = backend.encode("a")
    seq = enc.sequence_ids
    inner = [i for i, s in enumerate(seq) if s is not None]
    if not inner:
        return list(enc.ids), []
    return list(enc.ids[: inner[0]]), list(enc.ids[inner[-1] + 1 :])


class TokenizerCache:
    """``encode`` answers what ``backend.encode(text, add_special_tokens).ids`` would. Single-threaded (the
    router's event loop, or one tokenize worker)."""

    def __init__(self, backend: Any, l0_max_entries: int = 0, l1_max_bytes: int = 0) -> None:
        why = encode_refusal(backend)
        if why is not None:
            raise ConfigError(f"--tokenizer-cache-enable-l0 / -l1: {why}; drop the flag")
        env.serial_tokenizers()  # the pieces missing from L1 are encoded in one batch, in this thread
        self.backend = backend
        self.l0_max_entries = l0_max_entries
        self.l1_max_bytes = l1_max_bytes
        self._l0: OrderedDict[str, tuple[bool, array[int]]] = OrderedDict()
        self._l1: OrderedDict[str, array[int]] = OrderedDict()
        self.l1_bytes = 0
        self.l0_hits = self.l0_misses = self.l1_hits = self.l1_misses = 0  # L1: pieces
        self._cut: re.Pattern[str] | None = None
        self._pre: list[int] = []
        self._post: list[int] = []
        if l1_max_bytes:
            why = l1_refusal(backend)
            if why is not None:
                raise ConfigError(f"--tokenizer-cache-enable-l1: {why}; drop the flag")
            self._cut = re.compile("|".join(map(re.escape, isolating_tokens(backend))))
            self._pre, self._post = special_ends(backend)

    @property
    def l0_entries(self) -> int:
        return len(self._l0)

    @property
    def l1_entries(self) -> int:
        return len(self._l1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        l0 = self._l0 if self.l0_max_entries else None
        if l0 is not None:
            hit = l0.get(text)
            if hit is not None and hit[0] == add_special_tokens:
                l0.move_to_end(text)
                self.l0_hits += 1
                return hit[1].tolist()
            self.l0_misses += 1
        ids = self._by_pieces(text, add_special_tokens) if self._cut is not None else None
        if ids is None:
            ids = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if l0 is not None and len(text) <= L0_MAX_CHARS:
            l0[text] = (add_special_tokens, array("I", ids))
            if len(l0) > self.l0_max_entries:
                l0.popitem(last=False)
        return ids

    def _by_pieces(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """The text's ids from its pieces' (L1), or None when it has no cut."""
        assert self._cut is not None
        pieces = []
        start = 0
        for m in self._cut.finditer(text):
            pieces.append(text[start : m.end()])
            start = m.end()
        if not pieces:
            return None
        if start < len(text):
            pieces.append(text[start:])
        l1 = self._l1
        found = [l1.get(p) for p in pieces]
        missing = list(dict.fromkeys(p for p, f in zip(pieces, found, strict=True) if f is None))
        new: dict[str, array[int]] = {}
        if missing:
            self.l1_misses += len(missing)
            for p, enc in zip(missing, self.backend.encode_batch_fast(missing, add_special_tokens=False),
                              strict=True):
                new[p] = array("I", enc.ids)
        self.l1_hits += len(pieces) - len(missing)
        ids = list(self._pre) if add_special_tokens else []
        for p, f in zip(pieces, found, strict=True):
            if f is None:
                f = new[p]
            else:
                l1.move_to_end(p)
            ids += f.tolist()
        for p, arr in new.items():
            self._keep(p, arr)
        if add_special_tokens:
            ids += self._post
        return ids

    def _keep(self, piece: str, ids: array[int]) -> None:
        size = sys.getsizeof(piece) + sys.getsizeof(ids) + ENTRY_BYTES
        if size > self.l1_max_bytes or piece in self._l1:
            return
        l1 = self._l1
        while l1 and self.l1_bytes + size > self.l1_max_bytes:
            old, old_ids = l1.popitem(last=False)
            self.l1_bytes -= sys.getsizeof(old) + sys.getsizeof(old_ids) + ENTRY_BYTES
        l1[piece] = ids
        self.l1_bytes += size
