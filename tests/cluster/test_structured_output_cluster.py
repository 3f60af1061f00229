"""Structured output through the whole serving path, on real node processes (random-weight tiny model) behind an
in-process router, with the official ``openai`` client: P/D (1 prefill + 2 decode nodes, tcp) and a colocated node.

In P/D the prefill node samples the first token under the grammar and the decode node advances its matcher with it
before sampling the second: a regex with a forced first character and JSON schemas validate only if both hold. A
decode node killed mid-output migrates and the final JSON still validates. Unsupported fields and bad grammars are
400s naming the problem; the SGLang ``/generate`` surface and the gRPC Router API take the same fields.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import grpc
import jsonschema
import openai
import pytest

from common.ports import pick_free_port as free_port
from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.config import RouterConfig, WorkerSpec
from router.server import RouterServer
from tests.engine.test_structured_output import SCHEMAS
from tests.node_helpers import Node, start_node
from tests.nodes.test_nodes import FAST_DEADLINES

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 420
REGEX = r"Z[a-c]{2,6}-[0-9]{1,3}"  # a forced first character: the prefill node's sampled token


class Nodes:
    def __init__(self, p: Node, d1: Node, d2: Node, c: Node, sglang_port: int, prefill_sglang_port: int) -> None:
        self.p, self.d1, self.d2, self.c, self.sglang_port = p, d1, d2, c, sglang_port
        self.prefill_sglang_port = prefill_sglang_port

    def live(self) -> list[Node]:
        return [n for n in (self.p, self.d1, self.d2, self.c) if n.proc.poll() is None]


@pytest.fixture(scope="module")
def nodes(model_path) -> Iterator[Nodes]:
    sglang_port, prefill_sglang_port = free_port(), free_port()
    started = [
        start_node("prefill", model_path, extra=[*FAST_DEADLINES, "--sglang-http-port", str(prefill_sglang_port)],
                   wait=False),
        start_node("decode", model_path, extra=FAST_DEADLINES, wait=False),
        start_node("decode", model_path, extra=FAST_DEADLINES, wait=False),
        start_node("null", model_path, extra=["--sglang-http-port", str(sglang_port)], wait=False),
    ]
    try:
        for n in started:
            n.wait_ready(timeout=START_TIMEOUT_S)  # four nodes load side by side
    except BaseException:
        for n in started:
            n.kill()
        raise
    yield Nodes(*started, sglang_port, prefill_sglang_port)
    for n in started:
        if n.proc.poll() is None:
            n.proc.send_signal(signal.SIGTERM)
    for n in started:
        n.stop()


def workers(nodes: Nodes, mode: str) -> tuple[WorkerSpec, ...]:
    if mode == "colocated":
        return (WorkerSpec(nodes.c.addr, "colocated"),)
    return (WorkerSpec(nodes.p.addr, "prefill", nodes.p.bootstrap_port), WorkerSpec(nodes.d1.addr, "decode"),
            WorkerSpec(nodes.d2.addr, "decode"))


@pytest.fixture(params=["pd", "colocated"])
async def router(request, nodes, model_path) -> AsyncIterator[RouterServer]:
    server = RouterServer(RouterConfig(
        model_path=str(model_path), grpc_port=0, http_port=0, health_interval_s=0.5, load_interval_s=0.2,
        request_timeout_s=300.0, workers=workers(nodes, request.param), tool_call_parser="hermes",
    ))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)
        for n in nodes.live():
            n.wait_pools_free()


def client(server: RouterServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)


async def chat_json(c: openai.AsyncOpenAI, model: str, schema: dict[str, Any], seed: int, stream: bool) -> tuple[
        str, str | None]:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": f"Give me an answer, please ({seed})."}]
    if not stream:
        r = await c.chat.completions.create(model=model, messages=messages, max_tokens=160, temperature=1.0,
                                            seed=seed, response_format=fmt)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await c.chat.completions.create(model=model, messages=messages, max_tokens=160,
                                                       temperature=1.0, seed=seed, response_format=fmt,
                                                       stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


async def test_json_schema_outputs_validate_streaming_and_not(router) -> None:
    async with client(router) as c:
        model = (await c.models.list()).data[0].id
        cases = [(schema, seed, stream) for seed, schema in enumerate(SCHEMAS.values()) for stream in (False, True)]
        outs = await asyncio.gather(*(chat_json(c, model, s, 40 + k, st) for k, (s, _, st) in enumerate(cases)))
    for (schema, _, _), (text, finish) in zip(cases, outs, strict=True):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


async def test_regex_json_object_and_grpc(router) -> None:
    async with client(router) as c:
        model = (await c.models.list()).data[0].id
        for seed in range(4):
            r = await c.completions.create(model=model, prompt=f"code {seed}:", max_tokens=24, temperature=1.0,
                                           seed=seed, extra_body={"regex": REGEX})
            assert r.choices[0].finish_reason == "stop" and re.fullmatch(REGEX, r.choices[0].text), r.choices[0]
        r = await c.chat.completions.create(model=model, messages=[{"role": "user", "content": "json"}],
                                            max_tokens=24, temperature=0, response_format={"type": "json_object"})
        text = r.choices[0].message.content or ""
        assert text.startswith("{"), text
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    async with grpc.aio.insecure_channel(router.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        schema = SCHEMAS["enum_and_array"]
        sp = common_pb2.SamplingParams(max_new_tokens=120, temperature=1.0, seed=5, json_schema=json.dumps(schema))
        msgs = [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(
            text="grpc", sampling_params=sp, stream=True))]
        done = msgs[-1].complete
        assert done.finish_reason == "stop"
        jsonschema.validate(json.loads(done.text), schema)


async def test_bad_grammars_and_unsupported_fields_are_400(router) -> None:
    async with client(router) as c:
        model = (await c.models.list()).data[0].id
        msgs = [{"role": "user", "content": "x"}]
        with pytest.raises(openai.BadRequestError, match="regex cannot be compiled"):
            await c.completions.create(model=model, prompt="x", max_tokens=8, extra_body={"regex": "(unclosed"})
        with pytest.raises(openai.BadRequestError, match="json_schema cannot be compiled"):
            await c.chat.completions.create(model=model, messages=msgs, max_tokens=8, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
        with pytest.raises(openai.BadRequestError, match=r"response_format\.type"):
            await c.chat.completions.create(model=model, messages=msgs, max_tokens=8,
                                            response_format={"type": "yaml"})  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="functions is not supported"):
            await c.chat.completions.create(model=model, messages=msgs, max_tokens=8, functions=[
                {"name": "f", "parameters": {"type": "object"}}])


async def test_sglang_generate_takes_json_schema_regex_ebnf(nodes) -> None:
    url = f"http://127.0.0.1:{nodes.sglang_port}/generate"
    schema = SCHEMAS["bounded_numbers"]
    async with aiohttp.ClientSession() as http:
        for params, check in [
            ({"json_schema": json.dumps(schema)}, lambda t: jsonschema.validate(json.loads(t), schema)),
            ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
            ({"ebnf": 'root ::= "(" [0-9]+ ")"'}, lambda t: re.fullmatch(r"\(\d+\)", t) or pytest.fail(t)),
        ]:
            body = {"text": "sglang", "sampling_params": {"max_new_tokens": 120, "temperature": 1.0, **params}}
            async with http.post(url, json=body) as resp:
                assert resp.status == 200, await resp.text()
                out = await resp.json()
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            check(out["text"])
        body = {"text": "x", "sampling_params": {"regex": "[a-"}}
        async with http.post(url, json=body) as resp:
            assert resp.status == 400 and "regex cannot be compiled" in await resp.text()


async def test_sglang_generate_n_choices_seeded_per_choice_whole_and_streamed(nodes) -> None:
    """``sampling_params.n`` on a colocated node's ``/generate``: a list of n bodies by index (a stream: chunks with
    their choice's index), choice i sampling with seed + i, so each equals a single request with that seed."""
    url = f"http://127.0.0.1:{nodes.sglang_port}/generate"
    sp = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        async def one(body: dict[str, Any]) -> Any:
            async with http.post(url, json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        singles = [(await one({"input_ids": [5, 6, 7], "sampling_params": {**sp, "seed": 40 + i}}))["output_ids"]
                   for i in range(3)]
        assert len({tuple(x) for x in singles}) > 1  # the seeds differ, so do the choices
        whole = await one({"input_ids": [5, 6, 7], "sampling_params": {**sp, "seed": 40, "n": 3}})
        assert [b["index"] for b in whole] == [0, 1, 2] and [b["output_ids"] for b in whole] == singles
        body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {**sp, "seed": 40, "n": 2}}
        async with http.post(url, json=body) as resp:
            assert resp.status == 200
            raw = (await resp.read()).decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]"
        last: dict[int, list[int]] = {}
        for e in events[:-1]:
            chunk = json.loads(e)
            last[chunk["index"]] = chunk["output_ids"]
        assert last == {0: singles[0], 1: singles[1]}
        for bad, where in [({"input_ids": [5], "sampling_params": {"n": 0}}, url),
                           ({"input_ids": [5], "sampling_params": {"n": 17}}, url),
                           ({"prompt": "x", "n": 2, "model": "m"}, url.replace("/generate", "/v1/completions"))]:
            async with http.post(where, json=bad) as resp:
                assert resp.status == 400 and "n must" in await resp.text(), bad
        # A disaggregated node's choices would share one bootstrap room: refused, naming what to do instead.
        pd_url = f"http://127.0.0.1:{nodes.prefill_sglang_port}/generate"
        body = {"input_ids": [5, 6], "sampling_params": {**sp, "n": 2}, "bootstrap_room": 7,
                "bootstrap_host": "127.0.0.1"}
        async with http.post(pd_url, json=body) as resp:
            text = await resp.text()
            assert resp.status == 400 and "needs a colocated node" in text and "own rooms" in text, text
    for n in [nodes.c, nodes.p]:
        n.wait_pools_free()


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["tz"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


async def tool_calls_of(c: openai.AsyncOpenAI, model: str, choice: Any, seed: int, stream: bool) -> tuple[
        list[tuple[str, str]], str | None]:
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    kw = {"model": model, "messages": msgs, "tools": TOOLS, "tool_choice": choice, "max_tokens": 200,
          "temperature": 1.0, "seed": seed}
    if not stream:
        r = await c.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls or []
        return [(t.function.name, t.function.arguments) for t in calls], r.choices[0].finish_reason
    calls: dict[int, list[str]] = {}
    finish = None
    async for chunk in await c.chat.completions.create(**kw, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish


async def test_tool_choice_required_and_named_return_valid_calls(router) -> None:
    async with client(router) as c:
        model = (await c.models.list()).data[0].id
        named = {"type": "function", "function": {"name": "get_time"}}
        cases = [(choice, seed, stream) for seed, choice in enumerate(["required", named, "required"])
                 for stream in (False, True)]
        outs = await asyncio.gather(*(tool_calls_of(c, model, ch, 70 + k, st) for k, (ch, _, st) in
                                      enumerate(cases)))
        for (choice, _, _), (calls, finish) in zip(cases, outs, strict=True):
            assert finish == "tool_calls" and calls, (choice, calls, finish)
            for name, arguments in calls:
                if choice is named:
                    assert name == "get_time"
                jsonschema.validate(json.loads(arguments), PARAMS[name])
        # auto with the hermes parser: this random model writes no <tool_call>, so the output is plain content.
        r = await c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                            max_tokens=8, temperature=0)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def running(node: Node) -> int:
    return sum(r.running + r.transfer + r.prealloc for r in node.load().ranks)


async def test_n_choices_are_seeded_per_choice_and_each_validates(router) -> None:
    schema = SCHEMAS["bounded_numbers"]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    kw: dict[str, Any] = {"messages": [{"role": "user", "content": "three answers"}], "max_tokens": 160,
                          "temperature": 1.0, "seed": 5, "n": 3, "response_format": fmt}
    async with client(router) as c:
        model = (await c.models.list()).data[0].id

        async def ask(stream: bool) -> list[tuple[str, str | None]]:
            if not stream:
                r = await c.chat.completions.create(model=model, **kw)
                return [(ch.message.content or "", ch.finish_reason) for ch in sorted(r.choices, key=lambda x: x.index)]
            texts: list[str] = ["", "", ""]
            finish: list[str | None] = [None, None, None]
            async for chunk in await c.chat.completions.create(model=model, stream=True, **kw):
                for ch in chunk.choices:
                    texts[ch.index] += ch.delta.content or ""
                    finish[ch.index] = ch.finish_reason or finish[ch.index]
            return list(zip(texts, finish, strict=True))

        first = await ask(False)
        again, streamed = await asyncio.gather(ask(False), ask(True))
    assert first == again == streamed  # each choice's seed makes it reproducible, streamed or not
    assert len({text for text, _ in first}) == 3, first  # seed + i: the choices differ
    for text, finish in first:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)



async def test_n_choices_in_pd_equal_colocated_and_move_the_prompt_once(nodes, model_path) -> None:
    """``n = 3`` through P/D: the choices go to one prefill and one decode node (the router pins them), equal the
    colocated node's seeded choices, and only the first one's transfer carries the prompt's full pages: the others
    share them on the decode node and receive the prompt's last page only."""
    body = {"prompt": " ".join(f"word{i}" for i in range(90)), "max_tokens": 12, "temperature": 1.0, "seed": 9,
            "n": 3}
    out: dict[str, Any] = {}
    for mode in ("pd", "colocated"):
        server = RouterServer(RouterConfig(model_path=str(model_path), grpc_port=0, http_port=0,
                                           health_interval_s=0.5, load_interval_s=0.2, request_timeout_s=300.0,
                                           workers=workers(nodes, mode)))
        await server.start()
        try:
            async with aiohttp.ClientSession() as http:
                models = await (await http.get(server.http_url + "/v1/models")).json()
                async with http.post(server.http_url + "/v1/completions",
                                     json={**body, "model": models["data"][0]["id"]}) as r:
                    assert r.status == 200, await r.text()
                    out[mode] = await r.json()
        finally:
            await server.stop(0)
    texts = {mode: [c["text"] for c in sorted(o["choices"], key=lambda c: c["index"])] for mode, o in out.items()}
    assert texts["pd"] == texts["colocated"] and len(set(texts["pd"])) == 3, texts
    ext = out["pd"]["pdcluster"]["choices"]
    assert len({e["served_by"] for e in ext}) == 1, ext
    moved = sorted(e["timing"]["transfer_bytes"] for e in ext)
    pages = -(-out["pd"]["usage"]["prompt_tokens"] // 16)  # the nodes' default --page-size
    assert pages > 2 and moved == [moved[0], moved[0], moved[0] * pages], moved
    for n in nodes.live():
        n.wait_pools_free()


async def test_decode_killed_mid_output_migrates_and_the_json_validates(nodes, model_path) -> None:
    """Last in this module: it kills a decode node."""
    # Strings bounded by length: the migrated attempt's grammar replays the first attempt's tokens through them.
    schema = {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 5}, "minItems": 24,
              "maxItems": 24}
    server = RouterServer(RouterConfig(
        model_path=str(model_path), grpc_port=0, http_port=None, health_interval_s=0.5, load_interval_s=0.2,
        request_timeout_s=120.0, workers=workers(nodes, "pd"),
    ))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            sp = common_pb2.SamplingParams(max_new_tokens=400, temperature=1.0, seed=11,
                                           json_schema=json.dumps(schema))
            req = router_pb2.RouterGenerateRequest(request_id="victim", text="many strings", sampling_params=sp,
                                                   stream=True)
            got, victim, done = 0, None, None
            async for m in stub.Generate(req):
                if m.HasField("complete"):
                    done = m.complete
                    break
                got += len(m.chunk.token_ids)
                if victim is None and got >= 8:
                    victim = next(d for d in (nodes.d1, nodes.d2) if running(d))
                    victim.kill()
            assert victim is not None and done is not None
            assert done.attempts == 2, "the request finished before its decode node died"
            assert done.finish_reason == "stop"
            jsonschema.validate(json.loads(done.text), schema)
    finally:
        await server.stop(0)
    for n in nodes.live():
        n.wait_pools_free()
