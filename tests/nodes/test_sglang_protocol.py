"""SGLang's ``/generate`` and OpenAI completion bodies -> the node's request (common/node/sglang_protocol.py,
sglang_openai.py): SGLang's names map onto ours, and what a node cannot honour is a 400, never silently dropped."""

from __future__ import annotations

import pytest

from common.engine.io_struct import TokenOut
from common.errors import InvalidRequestError
from common.node.sglang_openai import chat_to_generate, completion_to_generate
from common.node.sglang_protocol import finish_reason, parse_generate


def test_sglang_names_map_onto_the_node_request() -> None:
    req = parse_generate({
        "text": "hi", "stream": True, "return_logprob": False, "top_logprobs_num": 2, "rid": "r1",
        "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2**63 - 1, "model": None,
        "log_metrics": True, "return_hidden_states": False,  # what sglang-router adds: accepted
        "sampling_params": {"temperature": 0, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "max_new_tokens": 7,
                            "min_new_tokens": 2, "stop": "</s>", "stop_token_ids": [3], "ignore_eos": True,
                            "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1,
                            "sampling_seed": 42, "n": 1},
    })
    sp = req.sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_new_tokens, sp.min_new_tokens) == (
        0.0, 0.9, 5, 0.1, 7, 2)
    assert sp.stop == ("</s>",) and sp.stop_token_ids == (3,) and sp.ignore_eos and sp.seed == 42
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.1)
    assert req.stream and req.return_logprob and req.top_logprobs_num == 2  # top-n implies logprobs
    assert (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room) == ("10.0.0.1", 8998, 2**63 - 1)
    assert parse_generate({"input_ids": [1, 2]}).sampling.max_new_tokens == 128  # SGLang's default is ours
    assert parse_generate({"input_ids": [1], "sampling_params": {"n": 3}}).n == 3


@pytest.mark.parametrize("body, field", [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "exactly one"),
    ({"text": ["a", "b"]}, "batches"),
    ({"input_ids": []}, "input_ids"),
    ({"text": "a", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"n": 2.5}}, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"structural_tag": "{}"}}, "structural_tag"),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "regex and ebnf"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"text": "a", "bootstrap_room": 2**64}, "bootstrap_room"),
    ({"text": "a", "bootstrap_port": 0}, "bootstrap_port"),
    ({"text": "a", "return_hidden_states": True}, "return_hidden_states"),
    ({"text": "a", "stream": "true"}, "stream"),
])
def test_bad_bodies_name_the_field(body, field) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        parse_generate(body)


def test_openai_completion_maps_to_generate() -> None:
    gen, usage = completion_to_generate({"prompt": "x", "max_tokens": 5, "min_tokens": 1, "seed": 3, "logprobs": 2,
                                          "stream": True, "stream_options": {"include_usage": True},
                                          "bootstrap_room": 9, "echo": False, "ignore_eos": True})
    req = parse_generate(gen)
    assert usage and req.stream and req.bootstrap_room == 9 and req.top_logprobs_num == 2
    assert (req.sampling.max_new_tokens, req.sampling.min_new_tokens, req.sampling.seed) == (5, 1, 3)
    assert parse_generate(completion_to_generate({"prompt": [5, 6]})[0]).input_ids == [5, 6]
    assert parse_generate(completion_to_generate({"prompt": "x"})[0]).sampling.max_new_tokens == 16  # OpenAI's
    for bad in ({"prompt": "x", "echo": True}, {"prompt": ["a", "b"]}, {"prompt": "x", "logprobs": 21}):
        with pytest.raises(InvalidRequestError):
            completion_to_generate(bad)


def test_finish_reasons_in_sglang_shape() -> None:
    def out(reason: str | None, matched: int | str | None = None) -> TokenOut:
        return TokenOut(rid="r", token_ids=[], finish_reason=reason, matched_stop=matched, error="gone")

    assert finish_reason(out(None), 8) is None
    assert finish_reason(out("length"), 8) == {"type": "length", "length": 8}
    assert finish_reason(out("stop", 2), 8) == {"type": "stop", "matched": 2}
    assert finish_reason(out("stop", "</s>"), 8) == {"type": "stop", "matched": "</s>"}
    assert finish_reason(out("abort"), 8) == {"type": "abort", "message": "gone"}


def test_openai_chat_maps_to_generate() -> None:
    gen, usage, messages = chat_to_generate({
        "messages": [{"role": "system", "content": None}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                      {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 6, "max_tokens": 9, "logprobs": True, "top_logprobs": 3, "bootstrap_room": 5,
        "separate_reasoning": True, "stream_reasoning": True, "skip_special_tokens": True})  # sglang-router's extras
    assert messages == [{"role": "system", "content": ""}, {"role": "user", "content": "ab"}] and not usage
    req = parse_generate({**gen, "input_ids": [1, 2]})
    assert req.sampling.max_new_tokens == 6 and req.top_logprobs_num == 3 and req.bootstrap_room == 5
    assert chat_to_generate({"messages": [{"role": "user", "content": "x"}]})[0]["sampling_params"][
        "max_new_tokens"] == 128
    for bad in ({"messages": []}, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                {"messages": [{"content": "x"}]}):
        with pytest.raises(InvalidRequestError):
            chat_to_generate(bad)
