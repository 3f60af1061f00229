"""The router's ``Tokenizer`` on the streaming path: text streamed through its memoized one-token decode is what
transformers' tokenizer streams (token by token, special tokens skipped or kept, multi-byte characters split over
tokens), and a streamed token the router has seen before costs one decode in the Rust tokenizer, not two."""

from __future__ import annotations

import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import load_tokenizer
from router.tokenizer.tokenizer import Tokenizer
from tests.model_fixtures import make_tiny_model

TEXT = ("Hello, world! caf\u00e9 \u4f60\u597d\uff0c\u4e16\u754c \U0001f600\U0001f44d\U0001f3fd "
        "digits 1234567890 <|im_end|></s> and some more plain words to stream")


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([t]) for t in ids] + [detok.add([], final=True)]


class _CountingDecoder:
    """The Rust tokenizer with its ``decode`` calls counted."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.calls = backend, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_streamed_text_is_transformers_token_by_token(arch: str) -> None:
    path = make_tiny_model(arch)
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tok = Tokenizer(load_tokenizer(path))
    rng = random.Random(0)
    seqs = [hf.encode(TEXT)] + [[rng.randrange(len(hf)) for _ in range(40)] for _ in range(20)]
    for ids in seqs:
        for skip in (True, False):
            assert _stream(IncrementalDetokenizer(tok, skip), ids) == _stream(IncrementalDetokenizer(hf, skip), ids)


def test_a_token_seen_before_is_decoded_once_when_streamed() -> None:
    tok = Tokenizer(load_tokenizer(make_tiny_model("llama")))
    assert tok._fast_decode is not None
    counter = tok._fast_decode = _CountingDecoder(tok._fast_decode)
    ids = tok.encode("plain ascii words, streamed one token at a time, none of them split over two tokens")
    assert len(ids) > 10
    first = "".join(_stream(IncrementalDetokenizer(tok, True), ids))
    before = counter.calls
    again = "".join(_stream(IncrementalDetokenizer(tok, True), ids))  # another request, the same tokens
    # The window before each new token is that one token, memoized: two decodes per token without it.
    assert counter.calls - before <= len(ids) + 1
    assert first == again == tok.decode(ids)


def test_a_character_split_over_tokens_does_not_decode_its_window_again_per_token() -> None:
    """While a character's bytes arrive over several tokens, nothing is read and the window before them stays the
    same: its text is kept, not decoded again with every token (1.81 decodes per token here before, 1.28 now)."""
    tok = Tokenizer(load_tokenizer(make_tiny_model("llama")))
    counter = tok._fast_decode = _CountingDecoder(tok._fast_decode)
    ids = tok.encode("\U0001f600\U0001f44d\U0001f3fd \u4f60\u597d\uff0c\u4e16\u754c \U0001f9d1\u200d\U0001f4bb" * 3)
    deltas = _stream(IncrementalDetokenizer(tok, True), ids)
    assert deltas.count("") > len(ids) / 3  # many tokens end inside a character
    before = counter.calls
    assert _stream(IncrementalDetokenizer(tok, True), ids) == deltas
    assert counter.calls - before < 1.5 * len(ids)
