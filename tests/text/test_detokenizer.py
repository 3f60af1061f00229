"""``IncrementalDetokenizer`` with stop strings: the streamed deltas join to the text cut before the first stop
string, however the tokens arrive, and it keeps no copy of the whole text while streaming (each token's work is
bounded by its window and the longest stop string)."""

from __future__ import annotations

import random

import pytest

from common.text.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """One token per character (id = code point)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def _reference(text: str, stop: tuple[str, ...]) -> tuple[str, str | None]:
    hits = [(text.find(s), s) for s in stop if s in text]
    if not hits:
        return text, None
    at, s = min(hits)
    return text[:at], s


@pytest.mark.parametrize("seed", range(40))
def test_streamed_deltas_join_to_the_text_cut_before_the_first_stop(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice("ab c\n") for _ in range(rng.randrange(1, 120)))
    stop = tuple(rng.choice(["ab", "a b", "c\nc", "bb a", "x", "\n\n", "cab c"]) for _ in range(rng.randrange(1, 4)))
    detok = IncrementalDetokenizer(CharTokenizer(), stop=stop)
    ids, streamed, i = [ord(c) for c in text], [], 0
    while i < len(ids):
        n = rng.randrange(1, 5)
        streamed.append(detok.add(ids[i:i + n]))
        i += n
        if detok.stopped:
            break
    streamed.append(detok.add([], final=True))
    want, matched = _reference(text, stop)
    assert "".join(streamed) == detok.text == want, (text, stop)
    assert detok.stopped == (matched is not None) and detok.matched_stop() == matched
    if not detok.stopped:
        for s in stop:
            assert s not in detok.text


def test_held_back_text_is_released_when_no_stop_follows() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), stop=("</end>",))
    assert detok.add([ord(c) for c in "hello </e"]) == "hello "
    assert detok.add([ord(c) for c in "nd"]) == ""  # "</end" still may become the stop
    assert detok.add([ord("!")]) == "</end!"
    assert detok.add([ord(c) for c in " </"], final=True) == " </"  # the end flushes what was held back
    assert detok.text == "hello </end! </" and not detok.stopped


@pytest.mark.parametrize("stop", [(), ("</stop>",)])
def test_no_copy_of_the_whole_text_is_kept_while_streaming(stop: tuple[str, ...]) -> None:
    """Before, the decoded text grew in one ``str`` copied at every token: quadratic in the output's length."""
    detok = IncrementalDetokenizer(CharTokenizer(), stop=stop)
    total = 0
    for i in range(5000):
        total += len(detok.add([ord("a") + i % 26]))
        longest = max((len(v) for v in vars(detok).values() if isinstance(v, str)), default=0)
        assert longest <= 16, f"a {longest}-character string held after {i + 1} tokens"
    assert total == 5000 and len(detok.text) == 5000
