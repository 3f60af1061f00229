"""Grammar-constrained decoding on the engine (common/engine/sampling/grammar.py), on the random-weight tiny model: its
output is noise, so only the grammar mask can make it parse.

Every output of a json_schema request validates against its schema, every regex output matches, over batch
compositions, the overlap schedule, chunked prefill, mixed chunks, retraction and a migrated request's replay; a
grammar that cannot compile is INVALID_ARGUMENT naming the problem; a dead end is a clear error, never garbage.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import pytest
import torch

from common.engine.sampling.grammar import allocate_bitmask, apply_bitmask
from common.errors import InvalidRequestError

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                               "name": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
                "required": ["id", "name"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "enum_and_array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        },
        "required": ["color", "tags"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": -10, "maximum": 10},
            "level": {"type": "integer", "enum": [1, 2, 3]},
        },
        "required": ["score", "count", "level"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["k", "v"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
}
PROMPTS = ["hello there", "the quick brown fox", "x", "numbers: 1 2 3 4"]
REGEXES = [r"[a-c]{2,5}@[xy]\.com", r"(yes|no|maybe)", r"-?[1-9][0-9]{0,3}\.[0-9]{2}"]
MAX_NEW = 160


def schema_requests(seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """(prompt, sampling params) for every schema x prompt, sampled (temperature 1, seeded)."""
    out = []
    for i, schema in enumerate(SCHEMAS.values()):
        for j, prompt in enumerate(PROMPTS):
            out.append((prompt, {"max_new_tokens": MAX_NEW, "temperature": 1.0, "seed": seed + 10 * i + j,
                                 "json_schema": json.dumps(schema)}))
    return out


def assert_valid_json(text: str, schema: dict[str, Any], finish: str | None) -> None:
    assert finish == "stop", f"finish {finish!r} for {text!r}"
    jsonschema.validate(json.loads(text), schema)


def run_all(engine: Any, reqs: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Submit every request at once (one batch), blocking until all finish."""
    import asyncio

    async def one(prompt: str, sp: dict[str, Any]) -> Any:
        last = None
        async for chunk in engine.generate_stream(prompt, sampling_params=sp):
            last = chunk
        return last.output

    async def main() -> list[Any]:
        return await asyncio.gather(*(one(p, sp) for p, sp in reqs), return_exceptions=True)

    outs = asyncio.run(main())  # every request ends before the loop closes; the first error is raised after
    for out in outs:
        if isinstance(out, BaseException):
            raise out
    return outs


@pytest.mark.parametrize(
    "overrides",
    [
        {"disable_overlap_schedule": True},
        {"enable_overlap_schedule": True},
        {"chunked_prefill_size": 16, "page_size": 4, "enable_mixed_chunk": True},
    ],
    ids=["normal", "overlap", "chunked-mixed"],
)
def test_every_json_schema_output_validates(engine_factory, model_path, overrides) -> None:
    engine = engine_factory(model_path, **overrides)
    reqs = schema_requests()
    if "chunked_prefill_size" in overrides:
        reqs = [(p + " and more words" * 6, sp) for p, sp in reqs]  # prompts over one chunk
    outs = run_all(engine, reqs)
    for (_, sp), out in zip(reqs, outs, strict=True):
        assert_valid_json(out.text, json.loads(sp["json_schema"]), out.finish_reason)


def test_greedy_json_schema_and_json_object_mode(engine_factory, model_path) -> None:
    engine = engine_factory(model_path)
    for schema in SCHEMAS.values():
        out = engine.generate("say it", sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0,
                                                         "json_schema": json.dumps(schema)})
        assert_valid_json(out.text, schema, out.finish_reason)
    # JSON-object mode: any object. A random model rarely closes a free-form string, so the output is checked as a
    # valid JSON prefix when the length ends it.
    out = engine.generate("obj", sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                  "json_schema": '{"type": "object"}'})
    assert out.text.startswith("{"), out.text
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_regex_and_ebnf_outputs_match(engine_factory, model_path) -> None:
    engine = engine_factory(model_path)
    reqs = [(p, {"max_new_tokens": 40, "temperature": 1.0, "seed": k, "regex": rx})
            for k, (p, rx) in enumerate((p, rx) for p in PROMPTS for rx in REGEXES)]
    for (_, sp), out in zip(reqs, run_all(engine, reqs), strict=True):
        assert out.finish_reason == "stop", out
        assert re.fullmatch(sp["regex"], out.text), (sp["regex"], out.text)
    ebnf = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [0-9]'
    out = engine.generate("calc", sampling_params={"max_new_tokens": 40, "temperature": 1.0, "seed": 3,
                                                   "ebnf": ebnf})
    assert out.finish_reason == "stop" and re.fullmatch(r"\(\d(\+\d)*\)", out.text), out.text


def test_retracted_requests_keep_their_grammar(engine_factory, model_path) -> None:
    # A tiny reserve per request admits more than fits: the running batch outgrows the KV cache and retracts.
    engine = engine_factory(model_path, max_total_tokens=260, page_size=1, schedule_conservativeness=0.05)
    reqs = [(p * 3, {**sp, "max_new_tokens": 80}) for p, sp in schema_requests(seed=100)]
    outs = run_all(engine, reqs)
    assert engine.scheduler.decode.num_retracted > 0, "the KV budget was meant to force retractions"
    for (_, sp), out in zip(reqs, outs, strict=True):
        assert_valid_json(out.text, json.loads(sp["json_schema"]), out.finish_reason)


def test_a_migrated_request_replays_its_outputs_into_the_matcher(engine_factory, model_path) -> None:
    engine = engine_factory(model_path)
    schema = SCHEMAS["nested"]
    sp = {"max_new_tokens": MAX_NEW, "temperature": 1.0, "seed": 7, "json_schema": json.dumps(schema)}
    prompt_ids = engine.tokenizer.encode("migrate me")
    whole = engine.generate(input_ids=prompt_ids, sampling_params=sp)
    k = len(whole.output_ids) // 2
    rest = engine.generate(input_ids=prompt_ids + whole.output_ids[:k], sampling_params=sp, prior_output_len=k)
    # Seeded draws continue where the first attempt was: the same tokens, a valid whole.
    assert whole.output_ids[:k] + rest.output_ids == whole.output_ids
    text = engine.tokenizer.decode(whole.output_ids[:k] + rest.output_ids, skip_special_tokens=True)
    assert_valid_json(text, schema, rest.finish_reason)
    bad = engine.tokenizer.encode("zzz", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="prior output token 0"):
        engine.generate(input_ids=prompt_ids + bad, sampling_params=sp, prior_output_len=len(bad))


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"regex": "(abc"}, ["regex cannot be compiled", "parenthesis"]),
        ({"json_schema": '{"type": "foo"}'}, ["json_schema cannot be compiled", "foo"]),
        ({"json_schema": "{not json"}, ["json_schema cannot be compiled", "JSON"]),
        ({"ebnf": "root ::= missing"}, ["ebnf cannot be compiled", "missing"]),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, ["at most one of json_schema, regex, ebnf"]),
        ({"regex": ""}, ["regex must not be empty"]),
    ],
)
def test_a_grammar_that_cannot_compile_is_invalid_argument(engine_factory, model_path, params, words) -> None:
    engine = engine_factory(model_path)
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("hi", sampling_params={"max_new_tokens": 8, **params})
    for word in words:
        assert word in str(info.value)
    assert engine.generate("hi", sampling_params={"max_new_tokens": 4}).finish_reason == "length"


def test_a_dead_end_is_a_clear_error_not_garbage(engine_factory, model_path) -> None:
    # "ok" completes the grammar: only EOS may follow, and min_new_tokens masks EOS.
    engine = engine_factory(model_path)
    with pytest.raises(InvalidRequestError, match=r"regex grammar reached a dead end after \d output tokens"):
        engine.generate("hi", sampling_params={"max_new_tokens": 16, "min_new_tokens": 5, "regex": "ok"})


def slow_schema(tag: str = "") -> str:
    """Small to send (3 KB), long to compile (about 20 s on an idle 2-core host): long repetition ranges in patterns
    cost xgrammar time that grows faster than the range."""
    props = {f"{tag}p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{3000 + i}}}x$"} for i in range(50)}
    return json.dumps({"type": "object", "properties": props})


def test_a_compile_past_its_deadline_is_stopped_and_the_step_never_waits(engine_factory, model_path) -> None:
    import threading

    engine = engine_factory(model_path, grammar_compile_timeout=1.0, grammar_compile_workers=1)
    pool = engine.scheduler.grammar_compiler.pool
    assert engine.generate("warm", sampling_params={"max_new_tokens": 4, "regex": "[ab]"}).text in ("a", "b")
    [worker] = pool.worker_pids()
    got: dict[str, Any] = {}

    def ask() -> None:
        with pytest.raises(InvalidRequestError) as info:
            engine.generate("hi", sampling_params={"max_new_tokens": 8, "json_schema": slow_schema()})
        got["error"] = str(info.value)

    t = threading.Thread(target=ask)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    plain = engine.generate("hi", sampling_params={"max_new_tokens": 4})
    assert time.monotonic() - t0 < 1.0 and plain.finish_reason == "length", "a plain request waited for a compile"
    t.join(timeout=60)
    assert "json_schema did not compile within 1 s (--grammar-compile-timeout) and its compile was stopped" in got[
        "error"]
    assert worker not in pool.worker_pids(), "the worker of a stopped compile is still alive"
    with pytest.raises(InvalidRequestError, match="did not compile within"):  # cached: refused without a compile
        engine.generate("hi", sampling_params={"max_new_tokens": 8, "json_schema": slow_schema()})
    assert not pool.worker_pids()
    assert re.fullmatch("q[a-z]{2}", engine.generate("hi", sampling_params={  # a fresh worker takes the next one
        "max_new_tokens": 8, "regex": "q[a-z]{2}"}).text)


def test_a_compile_queued_past_its_expiry_is_dropped(model_path) -> None:
    from common.engine.sampling import grammar

    pool = grammar_compiler(model_path, workers=1, timeout_s=1.0).pool
    try:
        slow = pool.submit("json_schema", slow_schema(), False)
        queued = pool.submit("regex", "[ab]+", False, expires=time.monotonic() + 0.3)
        with pytest.raises(grammar.GrammarCompileAborted, match="did not compile within 1 s"):
            slow.result(timeout=60)
        assert queued.cancelled()
        assert pool.submit("regex", "[ab]+", False).result(timeout=60).nbytes > 0
    finally:
        pool.close()


def grammar_compiler(model_path: Any, **kw: Any) -> Any:
    from common.engine.sampling import grammar
    from common.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    return grammar.GrammarCompiler(grammar.tokenizer_info(tok, len(tok), [tok.eos_token_id]), any_whitespace=False,
                                   **kw)


def test_compiled_grammars_are_cached_by_key_and_give_memory_back(model_path, monkeypatch) -> None:
    from common.engine.sampling import grammar

    compiler = grammar_compiler(model_path)
    trims = []
    monkeypatch.setattr(grammar, "release_freed_memory", lambda: trims.append(1))
    try:
        a = compiler.submit(("regex", "[ab]+"))
        assert compiler.submit(("regex", "[ab]+")) is a
        a.result(timeout=60)
        m1, m2 = compiler.matcher(("regex", "[ab]+")), compiler.matcher(("regex", "[ab]+"))
        assert m1.matcher is not m2.matcher  # one matcher per request over one compiled grammar
        one = compiler.cached_bytes
        assert one > 0 and not trims
        # A budget of about two grammars: the least recently used leave, and their memory goes back to the OS.
        monkeypatch.setattr(grammar, "GRAMMAR_CACHE_BYTES", 2 * one + one // 2)
        for k in range(4):
            compiler.submit(("regex", f"[ab]+{k}")).result(timeout=60)
        again = compiler.submit(("regex", "[ab]+"))
        assert again is not a  # evicted (at the next compile): compiled again
        # a submit evicts before its own compile counts: the others are within the budget once it is in
        nbytes = again.result(timeout=60).nbytes
        assert compiler.cached_bytes - nbytes <= grammar.GRAMMAR_CACHE_BYTES and trims
    finally:
        compiler.close()


def test_apply_bitmask_masks_rows_and_spares_dead_ones() -> None:
    vocab = 70
    scores = torch.randn(3, vocab)
    bitmask = allocate_bitmask(2, vocab)
    bitmask.zero_()
    bitmask[0, 1] = 1 << 3  # row 0 of the mask (batch row 2): only token 35
    out = apply_bitmask(scores, bitmask, torch.tensor([2, 0]), vocab)
    assert torch.equal(out[1], scores[1])  # no grammar
    assert torch.isneginf(out[2]).sum() == vocab - 1 and out[2, 35] == scores[2, 35]
    assert torch.equal(out[0], scores[0])  # nothing allowed: left to the matcher to refuse


@pytest.mark.slow  # spawns a TP rank process
def test_tp2_ranks_mask_alike_and_release(engine_factory, model_path) -> None:
    """Each TP rank runs its own matchers; they agree when a grammar is compiled and mask alike, so both ranks end
    every request the same way (a rank that drew differently would finish or refuse requests on its own and its
    free counts, reported as the MIN over the group, would stay short)."""
    engine = engine_factory(model_path, tp_size=2, torch_num_threads=1)
    reqs = schema_requests(seed=300)[::2]
    for (_, sp), out in zip(reqs, run_all(engine, reqs), strict=True):
        assert_valid_json(out.text, json.loads(sp["json_schema"]), out.finish_reason)
    deadline = time.monotonic() + 30
    while (load := engine.get_load()).free_req_slots != load.total_req_slots:
        assert time.monotonic() < deadline, load
        time.sleep(0.1)


def test_sglang_surfaces_take_grammars_and_refuse_what_they_do_not_serve() -> None:
    from common.node.sglang_openai import completion_to_generate
    from common.node.sglang_protocol import parse_generate

    req = parse_generate({"text": "x", "sampling_params": {"regex": "[ab]+", "max_new_tokens": 4}})
    assert req.sampling.regex == "[ab]+"
    with pytest.raises(InvalidRequestError, match="at most one"):
        parse_generate({"text": "x", "sampling_params": {"regex": "a", "json_schema": "{}"}})
    gen, _ = completion_to_generate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert gen["sampling_params"]["json_schema"] == '{"type": "object"}'
    gen, _ = completion_to_generate({"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}})
    assert json.loads(gen["sampling_params"]["json_schema"]) == {"type": "integer"}
    gen, _ = completion_to_generate({"prompt": "x", "logit_bias": {"7": 5.0}})
    assert parse_generate(gen).sampling.logit_bias == {7: 5.0}
    for bad in ({"response_format": {"type": "yaml"}}, {"tools": []}, {"best_of": 3}):
        with pytest.raises(InvalidRequestError):
            completion_to_generate({"prompt": "x", **bad})


def test_logit_bias_forces_and_bans_tokens(engine_factory, model_path) -> None:
    engine = engine_factory(model_path)
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    base = engine.generate("bias me", sampling_params=greedy).output_ids
    forced = engine.generate("bias me", sampling_params={**greedy, "logit_bias": {77: 100.0}}).output_ids
    assert forced == [77] * 6
    banned = engine.generate("bias me", sampling_params={**greedy, "logit_bias": {base[0]: -100.0}}).output_ids
    assert banned[0] != base[0]
    # Sampled rows too, in a batch beside an unbiased request; a grammar's mask still wins over a bias.
    outs = engine.generate(["bias me", "bias me"], sampling_params={
        "max_new_tokens": 4, "temperature": 1.0, "seed": 1, "ignore_eos": True, "logit_bias": {77: 100.0}})
    assert all(o.output_ids == [77] * 4 for o in outs)
    out = engine.generate("bias me", sampling_params={**greedy, "regex": "[ab]{3}", "logit_bias": {77: 100.0}})
    assert re.fullmatch("[ab]{3}", out.text)
    with pytest.raises(InvalidRequestError, match=r"logit_bias values must be in \[-100, 100\]"):
        engine.generate("x", sampling_params={**greedy, "logit_bias": {5: 300.0}})
    with pytest.raises(InvalidRequestError, match="logit_bias keys must be token ids"):
        engine.generate("x", sampling_params={**greedy, "logit_bias": {10**6: 1.0}})
