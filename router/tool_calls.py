"""OpenAI ``tools`` / ``tool_choice`` on the chat API: what the request asks of the model, and its output read back
into ``tool_calls``.

    tool_choice   grammar sent to the nodes                    output read by
    none          -                                            - (plain content)
    auto          -                                            --tool-call-parser (llama3 | hermes)
    required      json_schema: [{"name": f, "parameters": {..}}, ...] (one or more calls, each to a listed function)
    {function f}  json_schema: f's parameters                  the JSON is f's arguments

The tools are rendered by the model's chat template (``tools=`` of ``apply_chat_template``). Under ``required`` and a
named function the grammar makes the output parse, so even a random-weight model returns valid calls; values the
functions leave unbounded get default bounds (``bounded``) so a call always ends. An output cut by max_tokens is
still read as (partial) calls with finish_reason "length" (router/tool_call_parse.py), never as content.

Parsers (``--tool-call-parser``):
- ``llama3``: the whole output is one JSON object ``{"name": ..., "parameters"|"arguments": {...}}``, or several
  separated by ``;``.
- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; text before
  the first block is the message content.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from common.engine.sampling.json_schema import walk
from common.errors import InvalidRequestError
from router.tool_call_parse import (
    ToolCall,
    hermes_holds_back,
    parse_hermes,
    parse_llama3,
    parse_named,
    parse_required,
)

TOOL_CALL_PARSERS = ("llama3", "hermes", "qwen25")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Bounds the required / named grammars give what a function's schema leaves unbounded, so that a call always ends
# (a random or looping model would otherwise write one value until max_tokens). docs/api.md states them.
MAX_STRING_LENGTH = 256  # a string without maxLength, pattern, format, enum or const
MAX_ITEMS = 16  # an array without maxItems; also the calls of one required output
MAX_PROPERTIES = 16  # a free-form object (no properties, or additionalProperties allowed): keys beyond the named
MAX_KEY_LENGTH = 64  # a free-form object's keys
JSON_SAFE_INTEGER = 2**53 - 1  # integers and numbers without bounds: the range every JSON parser reads exactly
_SCALAR = {"anyOf": [{"type": "string", "maxLength": MAX_STRING_LENGTH},
                     {"type": "number", "minimum": -JSON_SAFE_INTEGER, "maximum": JSON_SAFE_INTEGER},
                     {"type": "boolean"}, {"type": "null"}]}  # what a free-form value may be


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask: ``mode`` is none / auto / required / named."""

    mode: str
    tools: tuple[dict[str, Any], ...]  # as the template gets them: {"type": "function", "function": {...}}
    named: str | None = None
    parser: str | None = None

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"

    def grammar(self) -> str | None:
        """The json_schema the nodes enforce, or None (auto, none). Values the functions leave unbounded get the
        bounds above."""
        params = {t["function"]["name"]: bounded(t["function"].get("parameters")) for t in self.tools}
        if self.mode == "named":
            assert self.named is not None
            return json.dumps(params[self.named])
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                      "required": ["name", "parameters"]} for name, schema in params.items()]
            return json.dumps({"type": "array", "minItems": 1, "maxItems": MAX_ITEMS, "items": {"anyOf": calls}})
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of an output; text that is not a call by the mode's rule: (text, []). A call cut
        short (or, under auto, written broken) is returned partial, never as content."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            assert self.named is not None
            return None, [parse_named(self.named, text)]
        if self.mode == "required":
            return None, parse_required(text)
        if self.parser in ("hermes", "qwen25"):
            return parse_hermes(text)
        return parse_llama3(text)

    def holds_back(self, text: str) -> int:
        """Streaming: how many characters at the start of ``text`` (the output so far) may go out as content now;
        the rest may belong to a tool call and is held until the output ends."""
        if self.mode in ("required", "named"):
            return 0
        if self.mode == "none":
            return len(text)
        if self.parser in ("hermes", "qwen25"):
            return hermes_holds_back(text)
        stripped = text.lstrip()
        return 0 if not stripped or stripped.startswith("{") else len(text)


def bounded(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters schema with the default bounds where it leaves a value unbounded (a copy). No
    parameters: the empty object."""
    if not parameters:
        return {"type": "object", "properties": {}}
    schema = copy.deepcopy(parameters)
    walk(schema, _bound)
    return schema


def _bound(node: dict[str, Any], path: str) -> None:
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if "enum" in node or "const" in node:
        return
    if not types and not any(k in node for k in ("anyOf", "oneOf", "allOf", "$ref", "not", "properties", "items",
                                                 "prefixItems", "pattern", "format", "minLength", "maxLength")):
        node.update(copy.deepcopy(_SCALAR))  # any value
        return
    if "string" in types and not any(k in node for k in ("maxLength", "pattern", "format")):
        node["maxLength"] = max(MAX_STRING_LENGTH, node.get("minLength", 0))
    if types & {"integer", "number"}:
        if "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = JSON_SAFE_INTEGER
        if "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = -JSON_SAFE_INTEGER
    if "array" in types and "maxItems" not in node:
        node["maxItems"] = max(MAX_ITEMS, node.get("minItems", 0))
    if "object" in types:
        extra = node.get("additionalProperties")
        if extra is True or ("properties" not in node and extra is None):
            node["additionalProperties"] = copy.deepcopy(_SCALAR)
        if extra is not False and ("properties" not in node or extra is not None):
            node.setdefault("maxProperties", len(node.get("properties", {})) + MAX_PROPERTIES)
            longest = max((len(k) for k in node.get("properties", {})), default=0)
            node.setdefault("propertyNames", {"type": "string", "maxLength": max(MAX_KEY_LENGTH, longest)})


def plan_of(tools: list[dict[str, Any]] | None, tool_choice: Any, parser: str | None) -> ToolPlan | None:
    """Validate ``tools`` / ``tool_choice`` (400 naming the field) and say what they ask; None without tools."""
    if not tools:
        if tool_choice is not None:
            raise InvalidRequestError("tool_choice requires tools")
        return None
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"tools[{i}].function.name must match {_NAME.pattern}, got {name!r}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON Schema object")
        names.append(name)
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique")
    choice = "auto" if tool_choice is None else tool_choice
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or named not in names:
            raise InvalidRequestError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                                      f'"function": {{"name": one of {names}}}}}, got {tool_choice!r}')
        mode = "named"
    elif choice in ("none", "auto", "required"):
        mode = choice
    else:
        raise InvalidRequestError(f'tool_choice must be "none", "auto", "required" or a named function, '
                                  f"got {tool_choice!r}")
    if mode == "auto" and parser is None:
        raise InvalidRequestError('tool_choice "auto" needs a tool-call parser: start the router with '
                                  '--tool-call-parser (llama3, hermes), or use tool_choice "required" or a named '
                                  "function")
    return ToolPlan(mode, tuple(tools), named, parser)
