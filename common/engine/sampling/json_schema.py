"""JSON Schemas made safe for the grammar engine before they compile, and the walk over a schema's subschemas.

xgrammar enforces ``minLength`` / ``maxLength`` alone with a character class that admits raw control characters
(U+0000-U+001F but CR and LF), which JSON forbids inside a string; its ``pattern`` path removes every character a JSON
string would have to escape (controls, ``"``, ``\\``) from each character match. So a string bounded by length is
compiled as the equivalent ``pattern`` ``^[\\s\\S]{min,max}$``: the same bounds over decoded characters (code
points, as JSON Schema counts them), JSON-legal by construction. xgrammar ignores length bounds beside a ``pattern``
or a ``format`` it enforces, and a ``pattern`` beside such a ``format``: those schemas are refused (INVALID_ARGUMENT
naming the place), never half-enforced.

    client schema ──> check_schema_depth (router and node: SamplingParams.verify)
                  ──> prepare_json_schema (node, in the compile worker) ──> xgrammar compile_json_schema
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from common.errors import InvalidRequestError

# JSON nesting of the schema document (an object property costs two levels: "properties" and the name). Compile time
# grows faster than linearly with depth; a schema a model can fill in is far shallower.
MAX_SCHEMA_DEPTH = 64
# Formats xgrammar enforces with a regex of its own (it then ignores ``pattern`` and length bounds beside them).
ENFORCED_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                              "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer"})

_ONE = ("items", "additionalProperties", "propertyNames", "contains", "not", "if", "then", "else",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[dict[str, Any], str]]:
    """The direct subschemas of ``schema`` (a dict) with their JSON paths; keywords that hold data (``enum``,
    ``const``, ``default``, ``examples``) are not entered."""
    for key in _ONE:
        sub = schema.get(key)
        if isinstance(sub, dict):
            yield sub, f"{path}.{key}"
    for key in _MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                if isinstance(sub, dict):
                    yield sub, f"{path}.{key}.{name}"
    for key in _LISTS:
        subs = schema.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                if isinstance(sub, dict):
                    yield sub, f"{path}.{key}[{i}]"


def walk(schema: Any, visit: Callable[[dict[str, Any], str], None]) -> None:
    """``visit(subschema, path)`` on ``schema`` and every subschema under it, parents first."""
    stack = [(schema, "$")] if isinstance(schema, dict) else []
    while stack:
        node, path = stack.pop()
        visit(node, path)
        stack.extend(reversed(list(subschemas(node, path))))


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON document (a scalar is 0, ``{}`` and ``[]`` are 1)."""
    depth, level = 0, [(value, 1)]
    while level:
        node, d = level.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        depth = max(depth, d)
        level.extend((c, d + 1) for c in children if isinstance(c, dict | list))
    return depth


def check_schema_depth(source: str) -> None:
    """A 400 naming the cap when ``source`` nests deeper than ``MAX_SCHEMA_DEPTH``; text that is not JSON is left to
    the compiler, which names the parse error."""
    depth: int | str
    try:
        depth = json_depth(json.loads(source))
    except RecursionError:  # deeper than the JSON parser goes
        depth = "too many"
    except ValueError:
        return
    if depth == "too many" or int(depth) > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"json_schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed "
                                  "(JSON nesting of the schema document): flatten it or reuse parts through $defs "
                                  "and $ref")


def prepare_json_schema(source: str) -> str:
    """``source`` as the schema xgrammar compiles into a JSON-legal grammar (see the module docstring); raises
    ``InvalidRequestError`` naming the place of a combination it cannot enforce."""
    try:
        schema = json.loads(source)
    except (ValueError, RecursionError):
        return source  # the compiler names the parse error
    walk(schema, _bound_string)
    return json.dumps(schema)


def _bound_string(node: dict[str, Any], path: str) -> None:
    bounds = [k for k in ("minLength", "maxLength") if k in node]
    fmt = node.get("format")
    enforced_format = isinstance(fmt, str) and fmt in ENFORCED_FORMATS
    if enforced_format and (bounds or "pattern" in node):
        other = " and ".join([*bounds, *(["pattern"] if "pattern" in node else [])])
        raise InvalidRequestError(f"json_schema at {path}: format {fmt!r} together with {other} cannot be enforced "
                                  "(the grammar engine follows the format alone); keep one of them")
    if not bounds:
        return
    if "pattern" in node:
        raise InvalidRequestError(f"json_schema at {path}: {' and '.join(bounds)} together with pattern cannot be "
                                  "enforced (the grammar engine follows the pattern alone); put the length into the "
                                  "pattern, e.g. ^[a-z]{1,8}$")
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    for name, value in (("minLength", lo), ("maxLength", hi)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InvalidRequestError(f"json_schema at {path}: {name} must be a non-negative integer, got {value!r}")
    if hi is not None and lo > hi:
        raise InvalidRequestError(f"json_schema at {path}: minLength {lo} is greater than maxLength {hi}")
    node.pop("minLength", None)
    node.pop("maxLength", None)
    node["pattern"] = f"^[\\s\\S]{{{lo},{'' if hi is None else hi}}}$"
