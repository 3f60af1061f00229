"""Incremental detokenization: text deltas from a growing list of token ids.

Never emits half a UTF-8 character, and never emits text that may turn out to be the start of a stop string:
the output a client sees is always the final text cut before the first stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

TOKEN_TEXT_CACHE = 1 << 16  # one-token texts memoized per tokenizer and skip_special_tokens flag (LRU beyond)


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text; a tokenizer's own ``decode_fn`` when it has one (the router's: straight into the Rust tokenizer)."""
    make = getattr(tokenizer, "decode_fn", None)
    if make is not None:
        return make(skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


def token_text(tokenizer: Any, skip_special_tokens: bool) -> Callable[[int], str] | None:
    """``decode([token])`` for ``tokenizer``, memoized in its ``token_texts`` (pdcluster's tokenizers have one; None
    for others): a token's text alone never changes, and the detokenizer reads each streamed token's text alone
    once (the window before the next token)."""
    per_flag: dict[bool, Callable[[int], str]] | None = getattr(tokenizer, "token_texts", None)
    if per_flag is None:
        return None
    fn = per_flag.get(skip_special_tokens)
    if fn is None:
        decode = _decoder(tokenizer, skip_special_tokens)
        fn = per_flag[skip_special_tokens] = lru_cache(TOKEN_TEXT_CACHE)(lambda t: decode([t]))
    return fn


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: tuple[str, ...] = ()) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._decode_one = token_text(tokenizer, skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._prefix = ""  # the text of ids[prefix_offset:read_offset] (the offsets only move together)
        self.full = ""  # all decoded text
        self.emitted = 0  # characters of ``full`` handed out
        self.stopped = False

    @property
    def text(self) -> str:
        return self.full[: self.emitted]

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the text that became final. ``final=True`` flushes everything held back."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        prefix = self._prefix
        new = self._decode(self.ids[self.prefix_offset :])
        if len(new) > len(prefix) and (final or not new.endswith("\ufffd")):
            self.full += new[len(prefix) :]
            p = self.prefix_offset = self.read_offset
            r = self.read_offset = len(self.ids)
            # The next window: in the steady state the one token just read, whose text alone never changes.
            if r - p == 1 and self._decode_one is not None:
                self._prefix = self._decode_one(self.ids[p])
            else:
                self._prefix = self._decode(self.ids[p:r])
        if not self.stop:  # nothing to hold back: every decoded character is final
            out = self.full[self.emitted :]
            self.emitted = len(self.full)
            return out
        return self._release(final)

    def _release(self, final: bool) -> str:
        end = len(self.full)
        for s in self.stop:
            at = self.full.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1 and at < end:
                end, self.stopped = at, True
        if not self.stopped and not final:
            end -= self._held_back()
        end = max(end, self.emitted)
        out = self.full[self.emitted : end]
        self.emitted = end
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of ``full`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.full)), best, -1):
                if self.full.endswith(s[:n]):
                    best = n
                    break
        return best
