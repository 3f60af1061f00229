"""OpenAI ``tools`` / ``tool_choice`` on the chat API: what the request asks of the model, and its output read back
into ``tool_calls``.

    tool_choice   grammar sent to the nodes                    output read by
    none          -                                            - (plain content)
    auto          -                                            --tool-call-parser (llama3 | hermes)
    required      json_schema: [{"name": f, "parameters": {..}}, ...] (one or more calls, each to a listed function)
    {function f}  json_schema: f's parameters                  the JSON is f's arguments

The tools are rendered by the model's chat template (``tools=`` of ``apply_chat_template``). Under ``required`` and a
named function the grammar makes the output parse, so even a random-weight model returns valid calls.

Parsers (``--tool-call-parser``):
- ``llama3``: the whole output is one JSON object ``{"name": ..., "parameters"|"arguments": {...}}``, or several
  separated by ``;``.
- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; text before
  the first block is the message content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.errors import InvalidRequestError

TOOL_CALL_PARSERS = ("llama3", "hermes", "qwen25")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


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
        """The json_schema the nodes enforce, or None (auto, none)."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.mode == "named":
            assert self.named is not None
            return json.dumps(params[self.named])
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                      "required": ["name", "parameters"]} for name, schema in params.items()]
            return json.dumps({"type": "array", "minItems": 1, "items": {"anyOf": calls}})
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output; no calls found: (text, [])."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            assert self.named is not None
            return None, [ToolCall(self.named, _compact(text))] if _is_json(text) else []
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []
            return None, [ToolCall(i["name"], json.dumps(i["parameters"])) for i in items]
        if self.parser in ("hermes", "qwen25"):
            return _parse_hermes(text)
        return _parse_llama3(text)

    def holds_back(self, text: str) -> int:
        """Streaming: how many characters at the start of ``text`` (the output so far) may go out as content now;
        the rest may belong to a tool call and is held until the output ends."""
        if self.mode in ("required", "named"):
            return 0
        if self.mode == "none":
            return len(text)
        if self.parser in ("hermes", "qwen25"):
            start = text.find(_HERMES_START)
            if start >= 0:
                return start
            for k in range(min(len(_HERMES_START) - 1, len(text)), 0, -1):  # a partial marker at the end
                if _HERMES_START.startswith(text[-k:]):
                    return len(text) - k
            return len(text)
        stripped = text.lstrip()
        return 0 if not stripped or stripped.startswith("{") else len(text)


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


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _compact(text: str) -> str:
    return json.dumps(json.loads(text))


def _call_of(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], json.dumps(args))


def _parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    stripped = text.strip()
    if not stripped.startswith("{"):
        return text, []
    calls = []
    for part in stripped.split(";"):
        try:
            call = _call_of(json.loads(part))
        except ValueError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(_HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], flags=re.S):
        try:
            call = _call_of(json.loads(block))
        except ValueError:
            continue
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls
