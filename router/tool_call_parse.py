"""Reading a chat output back into tool calls: whole calls, and the partial call an output cut short ends with.

A tool call is never turned into content. Which text is a call is the format's own rule:

    required   the whole output: a JSON array of {"name": f, "parameters": {...}}
    named      the whole output: the function's arguments
    llama3     an output that starts with {"name": ...}: one object, or several separated by ";"
    hermes     each <tool_call>...</tool_call> block (text before the first one is content)

A call that does not parse (the output was cut by max_tokens, or the model, unconstrained under ``auto``, wrote
broken JSON) is returned as far as it goes: its name when the text holds it whole (else the part there is), and its
``arguments`` as the raw text, which may not be valid JSON (as OpenAI says of its own calls).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

_DECODER = json.JSONDecoder()
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)', re.S)  # a call object's start, up to its name
_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.S)
_LLAMA3_CALL = re.compile(r'\s*\{\s*"name"\s*:', re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text (of a partial call: the text there is)
    id: str = field(default_factory=lambda: "call_" + uuid4().hex[:24])

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a ``required`` output ``[{"name": ..., "parameters": {...}}, ...]``, the last one partial when
    the output was cut; at least one (a cut before the first name gives one nameless call)."""
    pos = _skip_ws(text, 0)
    pos += text.startswith("[", pos)
    calls: list[ToolCall] = []
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            item, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            calls.append(partial_call(text[pos:]))
            break
        calls.append(_call_of(item) or partial_call(text[pos:end]))
        pos = _skip_ws(text, end)
        if not text.startswith(",", pos):
            break
        pos += 1
    return calls or [ToolCall("", "")]


def parse_named(name: str, text: str) -> ToolCall:
    """A named function's output is its arguments (compacted when they parse, else as written)."""
    try:
        return ToolCall(name, json.dumps(json.loads(text)))
    except ValueError:
        return ToolCall(name, text)


def parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    if not _LLAMA3_CALL.match(text):
        return text, []  # not a call by the format's rule: content, even if it is JSON
    calls, pos = [], 0
    while pos < len(text):
        try:
            obj, end = _DECODER.raw_decode(text, _skip_ws(text, pos))
        except ValueError:
            calls.append(partial_call(text[pos:]))
            break
        calls.append(_call_of(obj) or partial_call(text[pos:end]))
        pos = _skip_ws(text, end)
        if not text.startswith(";", pos):
            if text[pos:].strip():
                calls.append(partial_call(text[pos:]))
            break
        pos += 1
    return None, calls


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(_HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], flags=re.S):
        try:
            calls.append(_call_of(json.loads(block)) or partial_call(block))
        except ValueError:
            calls.append(partial_call(block))
    content = text[:start].strip()
    return content or None, calls


def hermes_holds_back(text: str) -> int:
    """Streaming: how much of ``text`` is surely content (before ``<tool_call>`` or a partial marker at the end)."""
    start = text.find(_HERMES_START)
    if start >= 0:
        return start
    for k in range(min(len(_HERMES_START) - 1, len(text)), 0, -1):
        if _HERMES_START.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def partial_call(text: str) -> ToolCall:
    """A call object that does not parse: the name as far as it is written, the arguments as raw text."""
    m = _NAME.match(text)
    if m is None:
        return ToolCall("", text.strip())
    raw, closed = m.group(1), m.group(2)
    try:
        name = json.loads(f'"{raw}"')
    except ValueError:
        name = raw.rstrip("\\")
    if not closed:
        return ToolCall(name, "")
    args = _ARGS.match(text, m.end())
    if args is None:
        return ToolCall(name, "")
    rest = text[args.end():]
    try:
        _, end = _DECODER.raw_decode(rest)
        return ToolCall(name, rest[:end])
    except ValueError:
        return ToolCall(name, rest.rstrip())


def _call_of(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return ToolCall(obj["name"], json.dumps(obj.get("arguments", obj.get("parameters", {}))))


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos
