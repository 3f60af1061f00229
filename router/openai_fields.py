"""Which OpenAI request fields this router serves, ignores on purpose, maps, or refuses (docs/api.md).

Every field a request may carry is declared on its msgspec struct (router/openai_protocol.py), and the structs forbid
unknown fields: a field that is neither served nor listed here is a 400 naming it, never a silent drop.

    harmless      accepted and ignored: they change nothing a client gets back (``HARMLESS``)
    refused       declared so the 400 names them: a 400 unless they hold their no-op value (``REFUSED``)
    vLLM guided_* mapped onto the grammar engine (``grammar_of``): guided_json -> json_schema, guided_regex ->
                  regex, guided_choice -> ebnf of the choices, guided_grammar -> ebnf
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from common.errors import InvalidRequestError

# Fields of OpenAI's API (and its SDKs) that change nothing here: bookkeeping for OpenAI's own storage, billing tier,
# abuse tracking and caching.
HARMLESS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
# Fields not served, with the values that mean "not used" (accepted as such).
REFUSED: dict[str, tuple[Any, ...]] = {
    "functions": (None,),
    "function_call": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "chat_template_kwargs": (None, {}),
    "continue_final_message": (None, False),
    "add_generation_prompt": (None, True),
    "lora_path": (None,),
    "guided_decoding_backend": (None, "xgrammar"),
    "guided_whitespace_pattern": (None,),
}
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$(.*)`)?")


def unknown_field_error(e: msgspec.ValidationError) -> InvalidRequestError | None:
    """The 400 for a request that carries a field no struct declares, or None for any other validation error."""
    m = _UNKNOWN.match(str(e))
    if m is None:
        return None
    where = f"{m.group(2).lstrip('.')}." if m.group(2) else ""
    return InvalidRequestError(f"{where}{m.group(1)} is not supported by this server; remove it (docs/api.md lists "
                               "the fields served)")


def refuse_unsupported(r: Any) -> None:
    """A 400 naming the first declared field the client set that this router does not serve."""
    for name, no_op in REFUSED.items():
        value = getattr(r, name, None)
        if not any(value == v and type(value) is type(v) for v in no_op):
            raise InvalidRequestError(f"{name} is not supported by this server; remove it (see docs/api.md)")


def grammar_of(r: Any) -> dict[str, str]:
    """The sampling field (json_schema, regex or ebnf) the request's response_format, regex, ebnf or vLLM guided_*
    field asks for; a 400 when it sets more than one."""
    asked: dict[str, tuple[str, str]] = {}  # client field -> (sampling field, grammar)
    f = r.response_format
    if f is not None:
        if f.type == "json_object":
            asked["response_format"] = ("json_schema", JSON_OBJECT_SCHEMA)
        elif f.type == "json_schema":
            if f.json_schema is None or f.json_schema.schema is None:
                raise InvalidRequestError(
                    'response_format.json_schema.schema is required with response_format.type "json_schema"'
                )
            asked["response_format"] = ("json_schema", msgspec.json.encode(f.json_schema.schema).decode())
        elif f.type != "text":
            raise InvalidRequestError(
                f'response_format.type must be "text", "json_object" or "json_schema", got {f.type!r}'
            )
    for name in ("regex", "ebnf"):
        if getattr(r, name) is not None:
            asked[name] = (name, getattr(r, name))
    if r.guided_json is not None:
        gj = r.guided_json
        asked["guided_json"] = ("json_schema", gj if isinstance(gj, str) else msgspec.json.encode(gj).decode())
    if r.guided_regex is not None:
        asked["guided_regex"] = ("regex", r.guided_regex)
    if r.guided_choice is not None:
        asked["guided_choice"] = ("ebnf", choice_grammar(r.guided_choice))
    if r.guided_grammar is not None:
        asked["guided_grammar"] = ("ebnf", r.guided_grammar)
    if len(asked) > 1:
        raise InvalidRequestError(f"set at most one of response_format, regex, ebnf, guided_json, guided_regex, "
                                  f"guided_choice, guided_grammar; got {', '.join(asked)}")
    return dict(asked.values())


def choice_grammar(choices: list[str]) -> str:
    """An EBNF whose language is exactly ``choices`` (vLLM's guided_choice)."""
    if not choices:
        raise InvalidRequestError("guided_choice must list at least one string")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
