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


def test_a_call_cut_short_is_a_partial_call_never_content() -> None:
    required = plan_of([WEATHER, TIME], "required", None)
    for text, name, args in [('[{"name": "get_time", "parameters": {"tz": 1', "get_time", '{"tz": 1'),
                             ('[{"name": "get_time", "parameters": {"tz": 1}}, {"name": "get_we', "get_we", ""),
                             ("[", "", "")]:
        body = oai.chat_body("r", "m", 0, [(text, "length", None)])
        oai.put_tool_calls(body, required, text)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        last = choice["message"]["tool_calls"][-1]["function"]
        assert (last["name"], last["arguments"]) == (name, args)
    named = plan_of([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    content, calls = named.parse('{"city": "Pa')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]
    delta, finish = oai.tool_call_delta(named, '{"city": "Pa', 0, "length")
    assert finish == "length" and delta["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'
    # auto: a call by the parser's own rule that does not parse is still a call; text that is not one is content.
    hermes = plan_of([WEATHER], "auto", "hermes")
    content, calls = hermes.parse('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Os')
    assert content == "Sure." and calls[0].name == "get_weather" and calls[0].arguments == '{"city": "Os'
    llama = plan_of([WEATHER], "auto", "llama3")
    content, calls = llama.parse('{"name": "get_weather", "parameters": {"city": ')
    assert content is None and calls[0].name == "get_weather"
    assert llama.parse('{"answer": 42}') == ('{"answer": 42}', [])


def test_unbounded_values_get_default_bounds_in_call_grammars() -> None:
    from router import tool_calls as tc

    params = {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0}, "x": {"type": "number"}, "s": {"type": "string", "minLength": 300},
        "tags": {"type": "array", "items": {"type": "string"}}, "free": {"type": "object"}, "any": {},
        "p": {"type": "string", "pattern": "^a+$"}, "e": {"enum": ["a", "b"]}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    schema = json.loads(plan_of([tool], {"type": "function", "function": {"name": "f"}}, None).grammar())
    props = schema["properties"]
    assert props["n"] == {"type": "integer", "minimum": 0, "maximum": tc.JSON_SAFE_INTEGER}
    assert props["x"]["minimum"] == -tc.JSON_SAFE_INTEGER and props["x"]["maximum"] == tc.JSON_SAFE_INTEGER
    assert props["s"]["maxLength"] == 300 and props["tags"]["maxItems"] == tc.MAX_ITEMS
    assert props["tags"]["items"]["maxLength"] == tc.MAX_STRING_LENGTH
    assert props["free"]["maxProperties"] == tc.MAX_PROPERTIES and "anyOf" in props["free"]["additionalProperties"]
    assert "anyOf" in props["any"]
    assert props["p"] == params["properties"]["p"] and props["e"] == params["properties"]["e"]
    assert params["properties"]["n"] == {"type": "integer", "minimum": 0}  # the client's schema is not changed
    required = json.loads(plan_of([tool], "required", None).grammar())
    assert required["maxItems"] == tc.MAX_ITEMS
    assert json.loads(plan_of([{"type": "function", "function": {"name": "g"}}], "required", None).grammar())[
        "items"]["anyOf"][0]["properties"]["parameters"] == {"type": "object", "properties": {}}
