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
    """Invariant: the text handed out is ``"".join(self._out)``; ``_pending`` holds the decoded characters after it
    (held back as a possible stop string's start, or the stop string and what follows once stopped). Each token's
    work is bounded by its window and the longest stop string, not by the text so far (a growing ``str`` copied at
    every token made a long stream's later tokens costlier: benchmarks/pages/serving_path.md)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: tuple[str, ...] = ()) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._decode_one = token_text(tokenizer, skip_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self._keep = max(map(len, self.stop), default=1) - 1  # emitted characters a stop string may start in
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._prefix = ""  # the text of ids[prefix_offset:read_offset] (the offsets only move together)
        self._out: list[str] = []  # the pieces handed out
        self._tail = ""  # the last ``_keep`` characters handed out
        self._pending = ""
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything handed out so far (joined once per call: read it at the end, not per token)."""
        if len(self._out) > 1:
            self._out = ["".join(self._out)]
        return self._out[0] if self._out else ""

    def matched_stop(self) -> str | None:
        """The stop string the text ended at, once stopped."""
        for s in self.stop:
            if self._pending.startswith(s):
                return s
        return None

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the text that became final. ``final=True`` flushes everything held back."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        prefix = self._prefix
        new = self._decode(self.ids[self.prefix_offset :])
        if len(new) > len(prefix) and (final or not new.endswith("\ufffd")):
            self._pending += new[len(prefix) :]
            p = self.prefix_offset = self.read_offset
            r = self.read_offset = len(self.ids)
            # The next window: in the steady state the one token just read, whose text alone never changes.
            if r - p == 1 and self._decode_one is not None:
                self._prefix = self._decode_one(self.ids[p])
            else:
                self._prefix = self._decode(self.ids[p:r])
        if not self.stop:  # nothing to hold back: every decoded character is final
            out, self._pending = self._pending, ""
            if out:
                self._out.append(out)
            return out
        return self._release(final)

    def _release(self, final: bool) -> str:
        window = self._tail + self._pending
        base = len(self._tail)
        end = len(window)
        for s in self.stop:
            at = window.find(s, max(0, base - len(s) + 1))
            if at != -1 and at < end:
                end, self.stopped = at, True
        if not self.stopped and not final:
            end -= self._held_back(window)
        end = max(end, base)
        out = window[base:end]
        self._pending = window[end:]
        if out:
            self._out.append(out)
            self._tail = window[max(0, end - self._keep) : end]
        return out

    def _held_back(self, window: str) -> int:
        """Length of the longest tail of ``window`` (the text's last characters) that is a proper prefix of a stop
        string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(window)), best, -1):
                if window.endswith(s[:n]):
                    best = n
                    break
        return best
