"""Stop conditions as the scheduler applies them token by token (``Req.take_token``): stop strings split across
tokens or inside a UTF-8 character, stop token ids, EOS and ``ignore_eos``, length vs stop precedence (CPU, no model)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common.engine.req import FinishReason, Req
from common.engine.sampling.params import SamplingParams
from common.engine.sampling.stop import stop_prefix_holdback, trim_stop_string
from tests.sampling_helpers import EOS, make_req

# -- stop conditions -------------------------------------------------------------------------------------------------
SENTENCES = [
    "Hello world, this is a tiny corpus.",
    "The quick brown fox jumps over the lazy dog.",
    "Stop here. Then continue with the rest of the story.",
    "café au lait and crème brûlée",
] * 4


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


def feed(req: Req, tokens: list[int], tokenizer: Tokenizer) -> int:
    """Append tokens one at a time as the scheduler does; return how many were consumed before finishing."""
    for n, t in enumerate(tokens, 1):
        req.take_token(t, tokenizer)
        if req.finished():
            return n
    return len(tokens)


def test_stop_string_split_across_tokens(tokenizer: Tokenizer) -> None:
    first, second = tokenizer.encode("Hello wor").ids, tokenizer.encode("ld again").ids
    r = make_req(stop=("world",), max_new_tokens=100)
    consumed = feed(r, first + second + tokenizer.encode(" more").ids, tokenizer)
    assert consumed == len(first) + 1  # finished on the token that completes "world", not before
    assert r.finished_reason is not None and r.finished_reason.reason == FinishReason.STOP
    assert r.finished_reason.matched == "world"
    text = tokenizer.decode(r.output_ids)
    assert text.startswith("Hello world") and trim_stop_string(text, ("world",)) == "Hello "


def test_stop_string_split_inside_a_utf8_character(tokenizer: Tokenizer) -> None:
    byte_tokens = [tokenizer.token_to_id(c) for c in "Ã©"]  # "é" as its two byte-level tokens
    r = make_req(stop=("é!",))
    consumed = feed(r, tokenizer.encode("caf").ids + byte_tokens + tokenizer.encode("!x").ids, tokenizer)
    assert r.finished_reason is not None and r.finished_reason.matched == "é!"
    assert tokenizer.decode(r.output_ids[:consumed]).endswith("café!")


def test_stop_token_ids_eos_and_ignore_eos(tokenizer: Tokenizer) -> None:
    r = make_req(max_new_tokens=10)
    assert feed(r, [20, 21, EOS, 22], tokenizer) == 3
    assert r.finished_reason is not None and r.finished_reason.reason == FinishReason.STOP
    assert r.finished_reason.matched == EOS

    r = make_req(max_new_tokens=10, ignore_eos=True, stop_token_ids=(30,))
    assert feed(r, [20, EOS, 21, 30, 22], tokenizer) == 4  # EOS ignored, the explicit stop token is not
    assert r.finished_reason is not None and r.finished_reason.matched == 30

    r = make_req(max_new_tokens=10, min_new_tokens=3, stop_token_ids=(30,))
    assert feed(r, [30, EOS, 30, 21], tokenizer) == 3  # stops honoured only from the 3rd token on


def test_length_and_stop_precedence(tokenizer: Tokenizer) -> None:
    r = make_req(max_new_tokens=3)
    assert feed(r, [20, 21, 22, 23], tokenizer) == 3
    assert r.finished_reason is not None and r.finished_reason.reason == FinishReason.LENGTH

    r = make_req(max_new_tokens=2)
    feed(r, [20, EOS], tokenizer)
    assert r.finished_reason is not None and r.finished_reason.reason == FinishReason.STOP

    r = make_req(max_new_tokens=5)
    r.abort("client went away")
    feed(r, [EOS], tokenizer)
    assert r.finished_reason is not None and r.finished_reason.reason == FinishReason.ABORT


def test_stop_string_not_matched_in_prompt(tokenizer: Tokenizer) -> None:
    r = Req("p", tokenizer.encode("Hello world").ids, SamplingParams(stop=("world",)))
    feed(r, tokenizer.encode(" again").ids, tokenizer)
    assert not r.finished()


def test_trim_stop_string_and_holdback() -> None:
    assert trim_stop_string("abc STOP def END", ("END", "STOP")) == "abc "
    assert trim_stop_string("no stop here", ("END",)) == "no stop here"
    assert stop_prefix_holdback("hello ST", ("STOP",)) == 2
    assert stop_prefix_holdback("hello", ("STOP",)) == 0
    assert stop_prefix_holdback("a\n", ("\n\n", "xyz")) == 1
