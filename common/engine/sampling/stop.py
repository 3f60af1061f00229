"""When a request stops, and cutting stop strings out of its text.

NOTE: order per step — the sampled token is appended to ``req.output_ids`` first, then ``check_finished(req, token,
tokenizer)`` runs. Checks, first match wins:

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

from typing import TYPE_CHECKING, Protocol

from common.engine.req import Finished, FinishReason

if TYPE_CHECKING:
    from common.engine.req import Req


class Detokenizer(Protocol):
    """What ``check_finished`` needs: ``tokenizers.Tokenizer`` and HF tokenizers both fit."""

    def decode(self, ids: list[int], /, *, skip_special_tokens: bool = ...) -> str: ...


def check_finished(req: Req, new_token: int, tokenizer: Detokenizer | None) -> None:
    """Set ``req.finished_reason`` if ``new_token`` (already ``req.output_ids[-1]``) ends the request."""
    if req.finished_reason is not None:
        return
    params = req.sampling_params
    n_out = len(req.output_ids)
    if n_out >= params.min_new_tokens:
        is_eos = not params.ignore_eos and new_token in req.eos_token_ids
        if is_eos or new_token in params.stop_token_ids:
            req.finished_reason = Finished(FinishReason.STOP, matched=new_token)
            return
        if params.stop:
            matched = _match_stop_string(req, tokenizer)
            if matched is not None:
                req.finished_reason = Finished(FinishReason.STOP, matched=matched)
                return
    if n_out >= params.max_new_tokens:
        req.finished_reason = Finished(FinishReason.LENGTH)


def _match_stop_string(req: Req, tokenizer: Detokenizer | None) -> str | None:
    params = req.sampling_params
    if tokenizer is None:
        raise ValueError(f"request {req.rid} has stop strings but the scheduler was given no tokenizer")
    window = max(len(s.encode("utf-8")) for s in params.stop) + 1
    ids = req.output_ids if len(req.output_ids) >= window else req.generated_ids()  # spans a migration
    tail = tokenizer.decode(ids[-window:], skip_special_tokens=params.skip_special_tokens)
    return _first_stop(tail, params.stop)[1]


def _first_stop(text: str, stop: tuple[str, ...]) -> tuple[int, str | None]:
    """(index, stop string) of the earliest match in ``text``; ties go to the earlier entry of ``stop``."""
    best_at, best = len(text), None
    for s in stop:
        at = text.find(s)
        if at != -1 and at < best_at:
            best_at, best = at, s
    return best_at, best


def trim_stop_string(text: str, stop: tuple[str, ...]) -> str:
    """``text`` cut before the first occurrence of any stop string (unchanged when none occurs)."""
    return text[: _first_stop(text, stop)[0]]


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
