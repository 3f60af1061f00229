"""A migrated request (``prior_output_len``: its last input ids are outputs of an interrupted attempt) continues
exactly as the uninterrupted run: seeded draws, repetition/frequency/presence penalties, min_new_tokens, logprobs."""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import InvalidRequestError

PROMPT = list(range(10, 40))
SAMPLING: dict[str, Any] = {
    "max_new_tokens": 24, "min_new_tokens": 14, "temperature": 1.0, "seed": 4321,
    "repetition_penalty": 1.3, "frequency_penalty": 1.0, "presence_penalty": 1.5,
}


def remaining(k: int) -> dict[str, Any]:
    """The sampling params the router sends after ``k`` tokens: the rest of the budget."""
    return {**SAMPLING, "max_new_tokens": SAMPLING["max_new_tokens"] - k,
            "min_new_tokens": max(0, SAMPLING["min_new_tokens"] - k)}


def test_seeded_penalised_request_continued_from_k_outputs_equals_the_uninterrupted_run(
    engine_factory, model_path
) -> None:
    engine = engine_factory(model_path)
    full = engine.generate(input_ids=PROMPT, sampling_params=SAMPLING, return_logprob=True)
    assert len(full.output_ids) > 12
    for k in (1, 9):
        cont = engine.generate(input_ids=PROMPT + full.output_ids[:k], sampling_params=remaining(k),
                               return_logprob=True, prior_output_len=k)
        assert cont.output_ids == full.output_ids[k:] and cont.finish_reason == full.finish_reason
        assert cont.logprobs == pytest.approx(full.logprobs[k:], abs=1e-4)
    # Without the field the continuation is a new request (draws restart at step 0, penalties forget the outputs):
    # the field is what makes it exact.
    fresh = engine.generate(input_ids=PROMPT + full.output_ids[:9], sampling_params=remaining(9))
    assert fresh.output_ids != full.output_ids[9:]
    with pytest.raises(InvalidRequestError, match="prior_output_len"):
        engine.generate(input_ids=PROMPT[:3], sampling_params=SAMPLING, prior_output_len=3)
