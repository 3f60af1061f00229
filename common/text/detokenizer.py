"""Incremental detokenization: text deltas from a growing list of token ids.

Never emits half a UTF-8 character, and never emits text that may turn out to be the start of a stop string:
the output a client sees is always the final text cut before the first stop string.
"""

from __future__ import annotations

from functools import partial
from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: tuple[str, ...] = ()) -> None:
        # ids -> text; a tokenizer's own ``decode_fn`` when it has one (the router's: straight into the Rust tokenizer)
        make = getattr(tokenizer, "decode_fn", None)
        self._decode = make(skip_special_tokens) if make is not None else partial(
            tokenizer.decode, skip_special_tokens=skip_special_tokens)
        # one token -> its text alone: a memoized ``decode_one_fn`` where the tokenizer has one
        make_one = getattr(tokenizer, "decode_one_fn", None)
        self._decode_one = make_one(skip_special_tokens) if make_one is not None else None
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
