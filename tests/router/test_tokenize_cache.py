"""The router's tokenizer caches (router/tokenize_cache.py): a cached encode is the uncached encode, for every
tokenizer shape the cache accepts, on texts built to cut at and around added tokens; L1 is refused where cutting
could change the ids; both levels stay within their bounds; a chat turn encodes only its new pieces."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from common.errors import ConfigError
from common.model_gen.tokenizer import CORPUS_PATH, train_tokenizer_json
from common.text.tokenizer import load_tokenizer
from router.config import RouterConfig
from router.tokenize_cache import TokenizerCache, isolating_tokens, l1_refusal
from router.tokenize_worker import worker_tokenizer
from router.tokenizer import Tokenizer as RouterTokenizer
from tests.model_fixtures import make_tiny_model

CORPUS = CORPUS_PATH.read_text(encoding="utf-8").splitlines(keepends=True)[:3000]
WORDS = [w for line in CORPUS[:400] for w in line.split()]
ODD = ["\n", "\n\n", " ", "  ", "\t", "x", "1", "_", "caf\u00e9", "\u4f60\u597d", "\U0001f600", "\u2581", "Hello"]


def _byte_level(extra: list[AddedToken] = ()) -> Tokenizer:  # type: ignore[assignment]
    """The generated models' tokenizer (ChatML specials, byte-level BPE) with ``extra`` added tokens."""
    tok = Tokenizer.from_str(train_tokenizer_json(512))
    tok.add_special_tokens(list(extra))
    return tok


def _word_level(extra: list[AddedToken]) -> Tokenizer:
    """Each run of spaces, and each word between them, one id (unknown ones too): a cut anywhere but at a split
    added token changes the ids, so a wrong cut cannot hide behind merges a small vocabulary lacks."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+"), "isolated")
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<s>", "<|im_start|>", "<|im_end|>")])
    tok.add_special_tokens(extra)
    return tok


def _sentencepiece(prepend_scheme: str | None, normalized: bool = False) -> Tokenizer:
    """A Llama-2-shaped tokenizer: BPE with byte fallback, "▁" for spaces (by a Metaspace pre-tokenizer, or by
    ``Prepend`` + ``Replace`` normalizers when ``prepend_scheme`` is None), a BOS added to every text."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    if prepend_scheme is None:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[
        ("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    if normalized:
        tok.add_tokens([AddedToken("<n>", normalized=True)])
    return tok


def _texts(tok: Tokenizer, n: int, seed: int) -> list[str]:
    """Texts that put every added token, and halves of them, before every kind of character, and run tokens into
    each other; then random mixes that repeat a shared opening (so L1 has pieces to reuse)."""
    rng = random.Random(seed)
    added = [t.content for t in tok.get_added_tokens_decoder().values()]
    halves = [a[:k] for a in added for k in (1, len(a) // 2, len(a) - 1) if 0 < k < len(a)]
    halves += [a[k:] for a in added for k in (1, len(a) // 2) if 0 < k < len(a)]
    out = [a + b + c for a, b in itertools.product(["", "x", "a", "<", " "], added) for c in ODD]
    out += [a + b + c for a, b, c in itertools.product(added + halves, added, ["", "\n", "x"])]
    # One token's end overlapping another's start: "ab<|im" + "<|im_end|>" -> "ab<|im_end|>".
    out += [v + t[k:] + c for v, t in itertools.product(added, added) for k in range(1, min(len(v), len(t)))
            if v[-k:] == t[:k] for c in ("", "x", "\n")]
    opening = "".join(rng.choice(added) + rng.choice(WORDS) for _ in range(4))
    parts = [*added, *halves, *ODD, *WORDS[:200]]
    for _ in range(n):
        body = "".join(rng.choice(parts) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 14)))
        out.append(opening + body if rng.random() < 0.5 else body)
    return out


def _check_exact(tok: Tokenizer, texts: list[str]) -> TokenizerCache:
    cache = TokenizerCache(tok, l0_max_entries=len(texts), l1_max_bytes=1 << 20)
    for special in (True, False):
        for rounds in range(2):  # the first round reuses pieces (L1), the second whole texts (L0)
            for text in texts:
                want = tok.encode(text, add_special_tokens=special).ids
                assert cache.encode(text, special) == want, (rounds, special, text)
    assert cache.l1_hits > 0 and cache.l0_hits > 0
    return cache


ACCEPTED = {
    "byte_level": lambda: _byte_level(),
    "qwen2": lambda: load_tokenizer(make_tiny_model("qwen2")).backend_tokenizer,
    "metaspace_always": lambda: _sentencepiece("always"),
    "prepend_normalizer": lambda: _sentencepiece(None, normalized=True),
    "word_level": lambda: _word_level([]),
    # Added tokens that isolate nothing, or only under conditions: the cache must still be exact.
    "rstrip": lambda: _word_level([AddedToken("<|end|>", rstrip=True, normalized=False, special=True)]),
    "lstrip": lambda: _word_level([AddedToken("<|end|>", lstrip=True, normalized=False, special=True)]),
    "contains": lambda: _word_level([AddedToken("<|im_end|>\n", normalized=False, special=True)]),
    "overlaps": lambda: _word_level([AddedToken("ab<|im", rstrip=True, normalized=False, special=True)]),
    "self_overlap": lambda: _word_level([AddedToken("<x<x", normalized=False, special=True)]),
    "single_word": lambda: _word_level([AddedToken("mask", single_word=True, normalized=False, special=True),
                                        AddedToken("<w", normalized=False, special=True)]),
    "normalized": lambda: _word_level([AddedToken("<n>", normalized=True)]),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_cached_encode_is_the_uncached_encode(name: str) -> None:
    tok = ACCEPTED[name]()
    assert l1_refusal(tok) is None
    _check_exact(tok, _texts(tok, 300, seed=len(name)))


def test_only_tokens_the_first_split_isolates_cut_texts() -> None:
    """Each excluded token would have cut wrongly somewhere in ``_texts`` (the exactness test above fails with the
    exclusion removed); ``<|im_start|>`` loses its place when another token ends with its start."""
    def isolating(extra: list[AddedToken]) -> set[str]:
        return set(isolating_tokens(_byte_level(extra)))

    assert isolating([]) == {"<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"}
    assert "<|end|>" not in isolating([AddedToken("<|end|>", rstrip=True, normalized=False)])
    assert "<|end|>" in isolating([AddedToken("<|end|>", lstrip=True, normalized=False)])
    assert "<|im_end|>" not in isolating([AddedToken("<|im_end|>\n", normalized=False)])
    assert not {"<|im_start|>", "<|im_end|>"} & isolating([AddedToken("ab<|im", rstrip=True, normalized=False)])
    assert "<x<x" not in isolating([AddedToken("<x<x", normalized=False)])
    assert "<w" not in isolating([AddedToken("mask", single_word=True, normalized=False),
                                  AddedToken("<w", normalized=False)])
    assert "<n>" not in isolating([AddedToken("<n>", normalized=True)])


def test_l1_is_refused_where_pieces_do_not_encode_alone() -> None:
    # Metaspace's prepend_scheme "first" prepends "▁" only at the text's start: a piece encoded alone gets one.
    first = _sentencepiece("first")
    assert "prepend_scheme first" in (l1_refusal(first) or "")
    cut = "[INST]hello"
    assert first.encode(cut, add_special_tokens=False).ids != (
        first.encode("[INST]", add_special_tokens=False).ids + first.encode("hello", add_special_tokens=False).ids)
    with pytest.raises(ConfigError, match=r"tokenizer-cache-enable-l1.*prepend_scheme first"):
        TokenizerCache(first, l1_max_bytes=1 << 20)
    TokenizerCache(first, l0_max_entries=8)  # L0 is exact for any deterministic tokenizer

    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel()
    with pytest.raises(ConfigError, match="no added token"):
        TokenizerCache(bare, l1_max_bytes=1 << 20)
    dropout = Tokenizer.from_str(train_tokenizer_json(512))
    dropout.model = models.BPE(dropout=0.5)
    with pytest.raises(ConfigError, match="dropout"):
        TokenizerCache(dropout, l0_max_entries=8)


def test_caches_stay_within_their_bounds_dropping_the_least_recently_used() -> None:
    tok = _byte_level()
    cache = TokenizerCache(tok, l0_max_entries=3, l1_max_bytes=2000)
    for i in range(6):
        cache.encode(f"prompt {i}")
    assert cache.l0_entries == 3
    cache.encode("prompt 3")  # used again: outlives 4 and 5
    cache.encode("prompt 6")
    hits = cache.l0_hits
    cache.encode("prompt 3")
    assert cache.l0_hits == hits + 1
    cache.encode("prompt 4")
    assert cache.l0_hits == hits + 1  # dropped

    for i in range(50):  # "kept<|im_end|>" is used by every text, so it stays while older pieces go
        cache.encode(f"kept<|im_end|>system {i}<|im_end|>user {i}<|im_end|>")
        assert 0 < cache.l1_bytes <= 2000
    assert cache.l1_entries < 100
    assert cache.l1_misses == 1 + 2 * 50  # "kept" was encoded once
    misses = cache.l1_misses
    cache.encode("kept<|im_end|>system 49<|im_end|>user 0<|im_end|>")  # only "user 0" was dropped
    assert cache.l1_misses == misses + 1


def test_a_chat_turn_encodes_only_its_new_pieces() -> None:
    path = make_tiny_model("llama")
    tok = RouterTokenizer(load_tokenizer(path), l1_max_bytes=1 << 20)
    plain = RouterTokenizer(load_tokenizer(path))
    assert tok.cache is not None
    encoded: list[str] = []
    backend: Any = tok.cache.backend

    class Counting:
        def encode_batch_fast(self, texts: list[str], add_special_tokens: bool = True) -> Any:
            encoded.extend(texts)
            return backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    tok.cache.backend = Counting()
    system = {"role": "system", "content": "You are a terse assistant. " * 20}
    chat = [system, {"role": "user", "content": "first question"}]
    assert tok.encode_chat(chat) == plain.encode_chat(chat)
    chat += [{"role": "assistant", "content": "first answer"}, {"role": "user", "content": "second question"}]
    encoded.clear()
    assert tok.encode_chat(chat) == plain.encode_chat(chat)
    # Pieces end after each special token; the system turn, the first question, "\n<|im_start|>" and the
    # generation prompt's "assistant\n" came from L1.
    assert encoded == ["assistant\nfirst answer<|im_end|>", "user\nsecond question<|im_end|>"]


def test_cache_flags_are_refused_where_they_would_do_nothing() -> None:
    with pytest.raises(ConfigError, match=r"--tokenizer-cache-l1-max-memory .* add --tokenizer-cache-enable-l1"):
        RouterConfig(tokenizer_cache_l1_max_memory=1 << 20)
    with pytest.raises(ConfigError, match=r"--tokenizer-cache-l0-max-entries .* add --tokenizer-cache-enable-l0"):
        RouterConfig(tokenizer_cache_l0_max_entries=5)
    RouterConfig(tokenizer_cache_enable_l1=True, tokenizer_cache_l1_max_memory=1 << 20)

    class Slow:  # a tokenizer without a Rust backend (transformers' slow tokenizers)
        chat_template = None

        def __len__(self) -> int:
            return 10

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1]

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "x"

    with pytest.raises(ConfigError, match="Rust tokenizer"):
        RouterTokenizer(Slow(), l0_max_entries=8)


def test_tokenize_workers_keep_an_l1_cache_of_their_own() -> None:
    path = make_tiny_model("llama")
    tok = worker_tokenizer(str(path), 1 << 20)
    assert tok.cache is not None and tok.cache.l1_max_bytes == 1 << 20 and not tok.cache.l0_max_entries
    assert worker_tokenizer(str(path), 0).cache is None
