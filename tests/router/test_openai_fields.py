"""The OpenAI surface's fields (router/openai_fields.py): unknown ones are a 400 naming them, harmless ones are
accepted, refused ones are a 400 unless they hold their no-op value, and vLLM's guided_* fields map onto the grammar
engine."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.errors import InvalidRequestError
from router import openai_fields
from router import openai_protocol as oai

MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return oai.chat_inputs(oai.decode(json.dumps({"messages": MSGS, **fields}).encode(), oai.ChatRequest), 8)


def completion(**fields: Any) -> dict[str, Any]:
    body = json.dumps({"prompt": "hi", **fields}).encode()
    return oai.completion_inputs(oai.decode(body, oai.CompletionRequest), 8)


@pytest.mark.parametrize(
    ("make", "fields", "words"),
    [
        (chat, {"top_a": 1}, "top_a is not supported by this server"),
        (completion, {"use_beam_search": True}, "use_beam_search is not supported"),
        (chat, {"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]},
         "messages[0].audio is not supported"),
        (chat, {"response_format": {"type": "json_object", "mode": "fast"}}, "response_format.mode is not supported"),
        (chat, {"stream": True, "stream_options": {"include_usage": True, "chunk": 1}},
         "stream_options.chunk is not supported"),
        (chat, {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs is not supported"),
        (chat, {"continue_final_message": True}, "continue_final_message is not supported"),
        (chat, {"add_generation_prompt": False}, "add_generation_prompt is not supported"),
        (completion, {"lora_path": "adapter"}, "lora_path is not supported"),
        (chat, {"verbosity": "low"}, "verbosity is not supported"),
        (completion, {"guided_decoding_backend": "outlines"}, "guided_decoding_backend is not supported"),
        (chat, {"guided_json": {"type": "object"}, "regex": "a"}, "set at most one of"),
        (completion, {"guided_choice": []}, "guided_choice must list at least one string"),
    ],
)
def test_unknown_and_unsupported_fields_are_400_naming_the_field(make, fields, words) -> None:
    with pytest.raises(InvalidRequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        make(**fields)


def test_harmless_fields_and_no_op_values_are_accepted() -> None:
    harmless = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                "prompt_cache_key": "k", "safety_identifier": "s"}
    assert set(harmless) == set(openai_fields.HARMLESS)
    no_ops = {"chat_template_kwargs": {}, "continue_final_message": False, "add_generation_prompt": True,
              "modalities": ["text"], "guided_decoding_backend": "xgrammar", "functions": None}
    kw = chat(**harmless, **no_ops, stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    assert "json_schema" not in kw["sampling"]
    turn = {"role": "assistant", "content": "x", "refusal": None, "annotations": [], "reasoning_content": "hm"}
    kw = chat(messages=[*MSGS, turn, {"role": "user", "content": "more"}])
    assert kw["messages"][1]["reasoning_content"] == "hm"
    completion(**harmless)
    for name in (*openai_fields.HARMLESS, *openai_fields.REFUSED):
        assert name in oai.CompletionRequest.__struct_fields__, name  # declared: never an unknown field


def test_vllm_guided_fields_map_onto_the_grammar_engine() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json.loads(chat(guided_json=schema)["sampling"]["json_schema"]) == schema
    assert json.loads(completion(guided_json=json.dumps(schema))["sampling"]["json_schema"]) == schema
    assert completion(guided_regex="[ab]+")["sampling"]["regex"] == "[ab]+"
    assert completion(guided_grammar='root ::= "x"')["sampling"]["ebnf"] == 'root ::= "x"'
    ebnf = chat(guided_choice=["yes", 'a "quoted" one', "tab\there"])["sampling"]["ebnf"]
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    grammar = xgr.Grammar.from_ebnf(ebnf)
    assert all(accepts(grammar, c) for c in ["yes", 'a "quoted" one', "tab\there"])
    assert not accepts(grammar, "no") and not accepts(grammar, "ye")
