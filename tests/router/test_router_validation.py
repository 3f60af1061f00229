"""Bad input: each is a 400 / INVALID_ARGUMENT whose message names the field, and the router keeps serving."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import grpc
import openai
import pytest

from pdcluster.v1 import common_pb2, router_pb2
from router.testing import fleet

TOO_LONG = "word " * 3000  # > 2048 tokens of context

HTTP_CASES: list[tuple[str, Any, str]] = [
    ("/v1/completions", {"model": "mock-model", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "mock-model"}, "prompt"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "n": 9}, "n must be between 1 and 8"),
    ("/v1/completions", {"model": "other-model", "prompt": "hi"}, "model"),
    ("/v1/completions", {"model": "mock-model", "prompt": TOO_LONG}, "prompt"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "max_tokens": 4000}, "max_tokens"),
    ("/v1/completions", {"model": "mock-model", "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": "mock-model", "prompt": [1, 2, 999999]}, "input_ids[2]"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "stop_token_ids": [5] * 2000},
     "stop_token_ids accepts at most"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "top_k": 0}, "top_k"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "logit_bias": {"five": 3}}, "logit_bias keys"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "logit_bias": {"5": 300}}, "logit_bias values"),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": "x"}],
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        "--tool-call-parser",
    ),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "tool_choice": "none"},
        "tool_choice requires tools",
    ),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]},
        "modalities",
    ),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
        "functions",
    ),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": "x"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    ("/v1/chat/completions", {"model": "mock-model", "messages": []}, "messages"),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "wizard", "content": "x"}]},
        "messages[0].role",
    ),
    ("/v1/chat/completions", {"model": "mock-model", "messages": [{"content": "x"}]}, "role"),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": TOO_LONG}]},
        "prompt",
    ),
    (
        "/v1/chat/completions",
        {"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 5},
        "presence_penalty",
    ),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern is not supported"),
    ("/v1/completions", {"model": "mock-model", "prompt": "hi", "top_a": 0.2}, "top_a is not supported"),
]


async def _ok(http: aiohttp.ClientSession, url: str) -> None:
    async with http.post(
        url + "/v1/completions", json={"model": "mock-model", "prompt": "hi", "max_tokens": 2}
    ) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["usage"]["completion_tokens"] == 2


async def test_http_bad_inputs_are_400_naming_the_field() -> None:
    async with fleet(max_request_bytes=64 << 10) as f, aiohttp.ClientSession() as http:
        url = f.server.http_url
        for path, body, field in HTTP_CASES:
            async with http.post(url + path, json=body) as r:
                err = (await r.json())["error"]
                assert r.status == 400, (body, err)
                assert field in err["message"], (field, err["message"])
                assert err["type"] == "invalid_request_error"
            await _ok(http, url)
        async with http.post(
            url + "/v1/completions",
            data=b'{"model": "mock-model", "prompt": "hi"',
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
        await _ok(http, url)
        big = json.dumps({"model": "mock-model", "prompt": "x" * (100 << 10)})
        async with http.post(
            url + "/v1/completions", data=big, headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 413 and "--max-request-bytes" in (await r.json())["error"]["message"]
        await _ok(http, url)
        # The official client surfaces the message.
        client = f.openai()
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="mock-model", prompt="hi", temperature=-1)
        assert "temperature" in str(e.value)


def _req(**kw: Any) -> router_pb2.RouterGenerateRequest:
    sp = kw.pop("sp", {})
    return router_pb2.RouterGenerateRequest(sampling_params=common_pb2.SamplingParams(**sp), **kw)


GRPC_CASES: list[tuple[router_pb2.RouterGenerateRequest, str]] = [
    (_req(text=""), "prompt"),
    (_req(), "prompt text, input_ids or messages"),
    (_req(text="hi", sp={"max_new_tokens": 0}), "sampling_params.max_new_tokens"),
    (_req(text="hi", sp={"temperature": -1}), "temperature"),
    (_req(text="hi", sp={"top_p": 0}), "top_p"),
    (_req(text="hi", model="nope"), "model"),
    (_req(text=TOO_LONG), "prompt"),
    (_req(input_ids=router_pb2.TokenIds(ids=[])), "input_ids"),
    (_req(input_ids=router_pb2.TokenIds(ids=[5, -1])), "input_ids[1]"),
    (
        _req(messages=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="bot", content="x")])),
        "messages[0].role",
    ),
    (_req(text="hi", top_logprobs_num=99), "top_logprobs"),
]


async def test_grpc_bad_inputs_are_invalid_argument_naming_the_field() -> None:
    async with fleet() as f:
        stub = f.stub()
        for req, field in GRPC_CASES:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(req):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, e.value.details())
            assert field in e.value.details(), (field, e.value.details())
            msgs = [m async for m in stub.Generate(_req(text="hi", sp={"max_new_tokens": 2}))]
            assert msgs[-1].complete.usage.completion_tokens == 2


async def test_a_node_rejection_is_passed_through_not_retried() -> None:
    async with fleet(
        prefill=[{"fail_prefill": 1, "fail_code": grpc.StatusCode.INVALID_ARGUMENT}, {}],
        decode=1,
        prefill_policy="round_robin",
    ) as f:
        stub = f.stub()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(_req(text="hi")):
                pass
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "injected prefill failure" in e.value.details()
        )
        assert sum(len(w.received("prefill")) for w in f.prefill) == 1
