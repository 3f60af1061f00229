"""OpenAI tools on the chat API (router/tool_calls.py): validation of tools / tool_choice, the grammar that
enforces required and named calls, and the llama3 / hermes parsers (whole outputs and streamed hold-back)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.errors import InvalidRequestError
from router import openai_protocol as oai
from router.tool_calls import plan_of

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["tz"]}}}


def test_required_and_named_grammars_accept_exactly_the_calls() -> None:
    required = json.loads(plan_of([WEATHER, TIME], "required", None).grammar())
    jsonschema.validate([{"name": "get_time", "parameters": {"tz": 3}},
                         {"name": "get_weather", "parameters": {"city": "Oslo"}}], required)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_time", "parameters": {"tz": 99}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    named = plan_of([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert json.loads(named.grammar()) == WEATHER["function"]["parameters"]
    content, calls = named.parse('{"city": "Paris"}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                                        {"city": "Paris"})]


def test_parsers_read_calls_and_leave_plain_text() -> None:
    hermes = plan_of([WEATHER], "auto", "hermes")
    content, calls = hermes.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                  '{"city": "Oslo"}}\n</tool_call>')
    assert content == "Let me check." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert hermes.parse("no call here") == ("no call here", [])
    llama = plan_of([WEATHER, TIME], "auto", "llama3")
    content, calls = llama.parse('{"name": "get_time", "parameters": {"tz": 1}}; {"name": "get_weather", '
                                 '"parameters": {"city": "Paris"}}')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert llama.parse("{not json") == ("{not json", [])
    assert plan_of([WEATHER], "none", None).parse("x") == ("x", [])


def test_streaming_holds_back_only_what_may_be_a_call() -> None:
    hermes = plan_of([WEATHER], "auto", "hermes")
    assert hermes.holds_back("Hello <tool") == len("Hello ")
    assert hermes.holds_back("Hello <tool_call>{") == len("Hello ")
    assert hermes.holds_back("Hello world") == len("Hello world")
    llama = plan_of([WEATHER], "auto", "llama3")
    assert llama.holds_back('  {"name"') == 0 and llama.holds_back("Sure") == 4
    assert plan_of([WEATHER], "required", None).holds_back("[{") == 0
    delta, finish = oai.tool_call_delta(hermes, 'Hi <tool_call>{"name": "get_weather", "arguments": {}}', 3,
                                        "stop")
    assert finish == "tool_calls" and delta["tool_calls"][0]["function"]["name"] == "get_weather"
    assert delta["tool_calls"][0]["index"] == 0


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "words"),
    [
        (None, "required", None, "tool_choice requires tools"),
        ([{"type": "function"}], "auto", "hermes", "tools[0]"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "hermes", "tools[0].function.name"),
        ([WEATHER, WEATHER], "auto", "hermes", "unique"),
        ([WEATHER], {"type": "function", "function": {"name": "other"}}, None, "tool_choice"),
        ([WEATHER], "sometimes", None, "tool_choice"),
        ([WEATHER], "auto", None, "--tool-call-parser"),
    ],
)
def test_bad_tools_are_400_naming_the_field(tools, choice, parser, words) -> None:
    with pytest.raises(InvalidRequestError, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        plan_of(tools, choice, parser)


def test_chat_inputs_render_tools_and_refuse_two_constraints() -> None:
    body = {"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [WEATHER], "tool_choice": "required"}
    kw = oai.chat_inputs(oai.decode(json.dumps(body).encode(), oai.ChatRequest), 1)
    assert kw["tools"] == [WEATHER] and kw["tool_plan"].mode == "required"
    assert kw["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert kw["messages"][2]["tool_call_id"] == "c1"
    assert "json_schema" in kw["sampling"]
    body["response_format"] = {"type": "json_object"}
    with pytest.raises(InvalidRequestError, match="remove response_format"):
        oai.chat_inputs(oai.decode(json.dumps(body).encode(), oai.ChatRequest), 1)
