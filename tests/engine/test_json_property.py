"""Property: every output of a grammar that promises JSON is JSON that validates, on the random-weight tiny model
sampled at temperature 1 (seeds 0-199): json_schema with string bounds, patterns, enums, nested arrays and
objects, bounded numbers and anyOf; and tool_choice "required" (every response is tool calls that parse and
validate). Only the grammar can make noise parse."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from router.tool_calls import plan_of
from tests.engine.test_structured_output import run_all

PROPERTY_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}},
     "required": ["name", "tags"]},
    {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,4}$"},
        "kind": {"enum": ["a", "b\"q", 3, None]},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "n": {"type": "integer", "minimum": 0, "maximum": 500}},
     "required": ["code", "kind", "score", "n"]},
    {"type": "array", "minItems": 1, "maxItems": 4, "items": {"anyOf": [
        {"type": "string", "maxLength": 5},
        {"type": "integer", "minimum": -9, "maximum": 9},
        {"type": "object", "properties": {"k": {"type": "string", "minLength": 2, "maxLength": 4}},
         "required": ["k"]}]}},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "string", "maxLength": 3},
        "d": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}}},
        "required": ["c", "d"]}}, "required": ["b"]}}, "required": ["a"]},
]
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 10},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query", "limit"]}}},
    {"type": "function", "function": {"name": "mark", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}, "maxItems": 3},
                                         "flag": {"enum": ["on", "off"]}},
        "required": ["ids", "flag"]}}},
]
SEEDS = range(200)
MAX_NEW = 256


def test_every_sampled_json_schema_output_parses_and_validates(engine_factory, model_path) -> None:
    engine = engine_factory(model_path)
    reqs = [(f"answer {seed}", {"max_new_tokens": MAX_NEW, "temperature": 1.0, "seed": seed,
                                "json_schema": json.dumps(PROPERTY_SCHEMAS[seed % len(PROPERTY_SCHEMAS)])})
            for seed in SEEDS]
    bad = []
    for (_, sp), out in zip(reqs, run_all(engine, reqs), strict=True):
        try:
            assert out.finish_reason == "stop", out.finish_reason
            jsonschema.validate(json.loads(out.text), json.loads(sp["json_schema"]))
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append((sp["seed"], out.text, str(e)[:120]))
    assert not bad, f"{len(bad)} of {len(reqs)} outputs are not valid JSON for their schema: {bad[:3]}"


def test_every_sampled_required_tool_call_parses_and_validates(engine_factory, model_path) -> None:
    engine = engine_factory(model_path)
    plan = plan_of(TOOLS, "required", None)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    reqs = [(f"call a tool {seed}", {"max_new_tokens": MAX_NEW, "temperature": 1.0, "seed": seed,
                                     "json_schema": plan.grammar()}) for seed in SEEDS]
    bad = []
    for (_, sp), out in zip(reqs, run_all(engine, reqs), strict=True):
        content, calls = plan.parse(out.text)
        try:
            assert out.finish_reason == "stop" and content is None and calls, (out.finish_reason, content)
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), params[call.name])
        except (AssertionError, ValueError, KeyError, jsonschema.ValidationError) as e:
            bad.append((sp["seed"], out.text, str(e)[:120]))
    assert not bad, f"{len(bad)} of {len(reqs)} responses are not valid tool calls: {bad[:3]}"


def test_calls_to_functions_with_unbounded_values_complete(engine_factory, model_path) -> None:
    """Integers, strings and arrays without bounds: the call grammars bound them (router/tool_calls.py), so a call
    ends however long the model would write. The model is kept from ever ending a value itself (every token with a
    quote, comma or bracket is biased to -100): only the grammar's bounds end them."""
    params = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"},
                                               "xs": {"type": "array", "items": {"type": "integer"}}},
              "required": ["n", "s", "xs"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    plan = plan_of([tool], {"type": "function", "function": {"name": "f"}}, None)
    engine = engine_factory(model_path)
    closing = [t for t in range(len(engine.tokenizer)) if set(engine.tokenizer.decode([t])) & set('",]}')]
    reqs = [(f"call f {seed}", {"max_new_tokens": 1024, "temperature": 1.0, "seed": seed, "json_schema": plan.grammar(),
                                "logit_bias": dict.fromkeys(closing, -100.0)}) for seed in range(2)]
    for out in run_all(engine, reqs):
        assert out.finish_reason == "stop", f"ran to max_tokens: {out.text[:200]!r}"
        _, [call] = plan.parse(out.text)
        jsonschema.validate(json.loads(call.arguments), params)
