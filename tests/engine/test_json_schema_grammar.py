"""The JSON Schema grammar itself (common/engine/sampling/json_schema.py + xgrammar), without a model: random walks
through the compiled grammar over a character vocabulary that favours what JSON forbids raw (control characters,
quotes, backslashes) must end in JSON that validates, whatever string bounds, patterns or formats the schema uses;
combinations the engine cannot enforce are refused naming the place."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from common.engine.sampling.json_schema import MAX_SCHEMA_DEPTH, prepare_json_schema
from common.engine.sampling.params import SamplingParams
from common.errors import InvalidRequestError

# Every ASCII character alone, whole multi-byte characters, and a few multi-character pieces, as a tokenizer has.
VOCAB = [chr(b) for b in range(128)] + ["é", "中", "😀", '\\"', "\\\\", "\\u00", '"}', '", "', "ab"]
SPECIAL = [i for i, t in enumerate(VOCAB) if len(t) == 1 and (ord(t) < 0x20 or t in '"\\')]

S: Any = lambda **k: {"type": "string", **k}  # noqa: E731
SCHEMAS = {
    "maxLength": S(maxLength=6),
    "min+maxLength": S(minLength=2, maxLength=4),
    "multibyte": S(minLength=1, maxLength=2),
    "object": {"type": "object", "properties": {"a": S(maxLength=3), "b": {"type": "array", "maxItems": 3,
                                                                           "items": S(minLength=1, maxLength=2)}},
               "required": ["a"]},
    "anyOf": {"anyOf": [S(maxLength=3), {"type": "integer", "minimum": 0, "maximum": 9}]},
    "type-list": {"type": ["string", "null"], "maxLength": 3},
    "additionalProperties": {"type": "object", "additionalProperties": S(maxLength=2), "maxProperties": 3},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "null"},
                      "maxProperties": 3},
    "$defs": {"$defs": {"s": S(maxLength=4)}, "type": "array", "items": {"$ref": "#/$defs/s"}, "maxItems": 3},
    "pattern": S(pattern="^[a-z\"\\\\]{1,6}$"),
    "enum": {"enum": ['a"b', "x\\y", "c\u0001d", 1, None]},
    "date-time": S(format="date-time"),
    "email": S(format="email"),
    "json-pointer": S(format="json-pointer"),
}


def walk(compiled: Any, rng: random.Random, steps: int = 120) -> str | None:
    """One random path through the grammar; its text, or None when it did not end within ``steps`` tokens."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB) + 1)
    out = []
    for _ in range(steps):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = [t for t in range(len(VOCAB) + 1) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
        eos = len(VOCAB)
        if eos in allowed and (len(allowed) == 1 or rng.random() < 0.3):
            return "".join(out)
        special = [t for t in allowed if t in SPECIAL]
        t = rng.choice(special) if special and rng.random() < 0.5 else rng.choice([t for t in allowed if t != eos])
        assert matcher.accept_token(t)
        out.append(VOCAB[t])
    return None


@pytest.fixture(scope="module")
def compiler() -> Any:
    import xgrammar as xgr

    info = xgr.TokenizerInfo([t.encode() for t in VOCAB] + [b"</s>"], vocab_type=xgr.VocabType.RAW,
                             stop_token_ids=[len(VOCAB)])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_walk_through_a_schema_grammar_is_json_that_validates(compiler, name) -> None:
    from common.engine.sampling.grammar_worker import compile_grammar

    schema = SCHEMAS[name]
    compiled = compile_grammar(compiler, "json_schema", json.dumps(schema), any_whitespace=False)
    rng = random.Random(name)
    texts = [t for t in (walk(compiled, rng) for _ in range(40)) if t is not None]
    assert len(texts) >= 30, f"only {len(texts)} of 40 walks ended"
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            pytest.fail(f"{text!r} is not valid JSON for {name}: {str(e)[:100]}")


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        (S(pattern="^[a-z]+$", maxLength=3), ["$", "maxLength together with pattern", "put the length into"]),
        ({"properties": {"d": S(format="date", minLength=1)}}, ["$.properties.d", "format 'date'", "minLength"]),
        ({"items": S(format="email", pattern="^a")}, ["$.items", "format 'email' together with pattern"]),
        (S(minLength=5, maxLength=2), ["minLength 5 is greater than maxLength 2"]),
        (S(maxLength=-1), ["maxLength must be a non-negative integer"]),
    ],
)
def test_what_the_grammar_cannot_enforce_is_refused_naming_the_place(schema, words) -> None:
    with pytest.raises(InvalidRequestError) as info:
        prepare_json_schema(json.dumps(schema))
    for word in words:
        assert word in str(info.value)


def test_a_schema_nested_past_the_cap_is_refused_before_it_compiles() -> None:
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(400):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(InvalidRequestError, match=f"nests 801 levels deep; at most {MAX_SCHEMA_DEPTH} are allowed"):
        SamplingParams(json_schema=json.dumps(deep)).verify(None)
    with pytest.raises(InvalidRequestError, match="nests too many levels deep"):
        SamplingParams(json_schema="[" * 30000 + "]" * 30000).verify(None)
    shallow = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    SamplingParams(json_schema=json.dumps(shallow)).verify(None)
