"""When a request stops, and cutting stop strings out of its text.

NOTE: order per step — the sampled token is appended to ``req.output_ids`` first, then ``Req.check_finished(token,
tokenizer)`` runs (both inside ``Req.take_token``). Checks, first match wins:

1. once ``len(output_ids) >= min_new_tokens``: the token is an EOS id (unless ``ignore_eos``) or one of
   ``stop_token_ids`` -> ``STOP(matched=token)``;
2. once ``len(output_ids) >= min_new_tokens``: a stop string appears in the decoded tail -> ``STOP(matched=str)``;
3. ``len(output_ids) >= max_new_tokens`` -> ``LENGTH``.

A stop match outranks the length limit on the same token (the model did end; OpenAI and vLLM report "stop" too).
The output ids keep the stop token / the stop string's tokens; the text a client sees is cut before the stop
string with ``trim_stop_string`` (the router owns detokenization).

Stop strings are found by decoding only the last ``max_stop_bytes + 1`` output tokens: a stop string newly
completed by this token ends inside the token's bytes, every non-special token decodes to at least one byte, so
the whole match lies in that window (a leading partial UTF-8 character decodes to U+FFFD before the match).
"""

from __future__ import annotations

from typing import Protocol


class Detokenizer(Protocol):
    """What ``Req.check_finished`` needs: ``tokenizers.Tokenizer`` and HF tokenizers both fit."""

    def decode(self, ids: list[int], /, *, skip_special_tokens: bool = ...) -> str: ...


def stop_window(stop: tuple[str, ...]) -> int:
    """Output tokens whose decoded text holds every stop string the newest token may have completed."""
    return max(len(s.encode("utf-8")) for s in stop) + 1


def first_stop(text: str, stop: tuple[str, ...]) -> tuple[int, str | None]:
    """(index, stop string) of the earliest match in ``text``; ties go to the earlier entry of ``stop``."""
    best_at, best = len(text), None
    for s in stop:
        at = text.find(s)
        if at != -1 and at < best_at:
            best_at, best = at, s
    return best_at, best


def trim_stop_string(text: str, stop: tuple[str, ...]) -> str:
    """``text`` cut before the first occurrence of any stop string (unchanged when none occurs)."""
    return text[: first_stop(text, stop)[0]]


def stop_prefix_holdback(text: str, stop: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` may be the start of a stop string.

    A streaming client must not see them yet: the next tokens may complete the stop string.
    """
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
