"""OpenAI-compatible HTTP gateway (aiohttp) over ``RouterService``.

Streaming responses send their headers only with the first output, so every failure before the first token (after
the router's retries) is a real HTTP status (400/503/504) rather than an error inside a 200 stream. A client that
disconnects cancels its handler (``handler_cancellation``), which aborts both legs on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import uuid
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from common.errors import PdclusterError
from common.serving.client_gone import client_gone_middleware
from common.serving.event_stream import EventStreamResponse, delimit_event_stream
from router import openai_protocol as oai
from router.admin import admin_middleware
from router.choices import choice_requests, merge_choices
from router.client_auth import api_key_middleware
from router.errors import http_status_of, retry_after_of
from router.request import ClientRequest, Delta, Final, GenRequest
from router.service import RouterService
from router.sse import DeltaEvents, SseSink, sse
from router.tool_calls import ToolPlan

_encode = msgspec.json.encode


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json", headers=headers)


def error_response(e: BaseException, headers: dict[str, str] | None = None) -> web.Response:
    status = http_status_of(e)
    retry_after = retry_after_of(e)
    if retry_after is not None:
        headers = {**(headers or {}), "Retry-After": str(max(1, math.ceil(retry_after)))}
    return json_response(oai.error_body(str(e), status), status, headers)


class HttpGateway:
    def __init__(self, service: RouterService) -> None:
        self.service = service
        self.logprobs = oai.LogprobFormatter(service.core.tokenizer_hf)
        # request ids: a random per-process part and a counter (unique across replicas; no uuid4 per request)
        self._rid_base = uuid.uuid4().hex[:12]
        self._rid_seq = itertools.count()
        middlewares = [client_gone_middleware, admin_middleware(service.cfg.admin_token)]
        if service.cfg.api_keys:
            middlewares.insert(1, api_key_middleware(service.client_secrets))
        app = web.Application(client_max_size=service.cfg.max_request_bytes, middlewares=middlewares)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/workers", self.workers)
        app.router.add_get("/v1/requests/{rid}/timing", self.timing)
        app.router.add_get("/health", self.health)
        app.router.add_get("/liveness", self.liveness)
        app.router.add_get("/metrics", self.metrics)
        self.app = app

    # -- plain endpoints -------------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.service.model_name, "object": "model", "created": 0, "owned_by": "pdcluster"}
                ],
            }
        )

    async def workers(self, request: web.Request) -> web.Response:
        return json_response({"workers": self.service.list_workers()})

    async def timing(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        t = self.service.core.timings.get(rid)
        if t is None:
            return json_response(
                oai.error_body(
                    f"no timing for request {rid!r}: unknown, not finished, or older than the last "
                    f"{self.service.cfg.timing_keep} requests / {self.service.cfg.timing_ttl_s:.0f} s",
                    404,
                ),
                404,
            )
        return json_response({"id": rid, "timing": t})

    async def health(self, request: web.Request) -> web.Response:
        ok, why = self.service.ready()
        return json_response({"status": "ok" if ok else "unavailable", "reason": why}, 200 if ok else 503)

    async def liveness(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.service.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- generation ------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, api: str) -> web.StreamResponse:
        svc = self.service
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            limit = svc.cfg.max_request_bytes
            return json_response(
                oai.error_body(
                    f"request body is larger than the router's limit of {limit} bytes (--max-request-bytes)",
                    413,
                ),
                413,
            )
        try:
            if api == "chat":
                parsed: Any = oai.decode(body, oai.ChatRequest)
                kw = oai.chat_inputs(parsed, svc.cfg.max_n, svc.cfg.tool_call_parser)
            else:
                parsed = oai.decode(body, oai.CompletionRequest)
                kw = oai.completion_inputs(parsed, svc.cfg.max_n)
            plan = kw.pop("tool_plan", None)
            prefix = "chatcmpl-" if api == "chat" else "cmpl-"
            rid = (request.headers.get("X-Request-ID") or parsed.request_id
                   or f"{prefix}{self._rid_base}{next(self._rid_seq):012x}")
            req = await svc.build(ClientRequest(rid=rid, api=api, authorization=request.headers.get("Authorization"),
                                                **kw))
        except PdclusterError as e:
            return error_response(e)
        # n > 1: one request per choice (own rid ``<rid>-<i>``, seed + i), routed and admitted like any other.
        choices = choice_requests(req, parsed.n)
        headers = {"X-Request-ID": rid}
        model = svc.model_name
        created = oai.now_s()
        if not req.stream:
            finals: list[Final | None] = [None] * len(choices)
            try:
                async with contextlib.aclosing(merge_choices([svc.generate(c) for c in choices])) as events:
                    async for i, ev in events:
                        if isinstance(ev, Final):
                            finals[i] = ev
            except PdclusterError as e:
                return error_response(e, headers)
            done = [f for f in finals if f is not None]
            assert len(done) == len(choices)
            body = self._full_body(api, rid, done, model, created, req.top_logprobs_num, req.return_logprob)
            if plan is not None:
                for i, f in enumerate(done):
                    oai.put_tool_calls(body, plan, f.text, i)
            return json_response(body, headers=headers)
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return await self._stream(request, api, rid, model, created, req.return_logprob, include_usage, headers,
                                  choices, plan)

    def _full_body(
        self, api: str, rid: str, finals: list[Final], model: str, created: int, top_n: int, want_lp: bool
    ) -> dict[str, Any]:
        make = oai.chat_body if api == "chat" else oai.completion_body
        body = make(rid, model, created, [(f.text, f.finish_reason, self._logprobs_of(api, f, top_n, want_lp))
                                          for f in finals])
        body["usage"] = oai.usage_of(finals)
        body["pdcluster"] = oai.extension_of(finals[0]) if len(finals) == 1 else {
            "choices": [oai.extension_of(f) for f in finals]}
        return body

    def _logprobs_of(self, api: str, f: Final, top_n: int, want_lp: bool) -> dict[str, Any] | None:
        if not want_lp:
            return None
        if api == "chat":
            return self.logprobs.chat(f.output_ids, f.logprobs, f.top_logprobs)
        return self.logprobs.completion(f.output_ids, f.logprobs, f.top_logprobs if top_n else [], 0)

    async def _stream(
        self,
        request: web.Request,
        api: str,
        rid: str,
        model: str,
        created: int,
        want_lp: bool,
        include_usage: bool,
        headers: dict[str, str],
        choices: list[GenRequest],
        plan: ToolPlan | None = None,
    ) -> web.StreamResponse:
        """Stream the choices' events as SSE chunks; the choices' chunks interleave as their tokens arrive, each with
        its ``index``; usage and ``[DONE]`` follow the last choice's end. One choice: after its first event, its
        deltas are written by an ``SseSink`` as the node's messages arrive."""
        resp = EventStreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        delimit_event_stream(resp, request)
        n = len(choices)
        chat = api == "chat"
        deltas = DeltaEvents(api, rid, model, created, n, want_lp, plan, self.logprobs)
        sink: SseSink | None = None
        if n == 1:  # with several, a choice's reader hands its events to the others' merge (``merge_choices``)
            task = asyncio.current_task()
            assert task is not None
            sink = choices[0].delta_sink = SseSink(resp, deltas, task, request.transport)
        events = merge_choices([self.service.generate(c) for c in choices])
        finals: list[Final] = []
        async with contextlib.aclosing(events):
            try:
                async for i, ev in events:
                    if not resp.prepared:
                        await resp.prepare(request)
                        if chat:
                            await resp.write(b"".join(
                                sse(oai.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None,
                                                    index=k))
                                for k in range(n)))
                    if isinstance(ev, Delta):
                        data = deltas.of(i, ev)
                        if data is not None:
                            await resp.write(data)
                            if sink is not None:  # the head is out (with this event): the sink may write
                                sink.live = True
                        continue
                    finish, delta = ev.finish_reason, {}
                    if plan is not None:
                        delta, finish = oai.tool_call_delta(plan, deltas.texts[i], deltas.sent[i], finish)
                    last = (
                        oai.chat_chunk(rid, model, created, delta, finish, index=i)
                        if chat
                        else oai.completion_chunk(rid, model, created, "", ev.finish_reason, index=i)
                    )
                    last["pdcluster"] = oai.extension_of(ev)
                    finals.append(ev)
                    tail = [sse(last)]
                    if len(finals) < n:
                        await resp.write(tail[0])
                        continue
                    if include_usage:
                        usage = {
                            "id": rid,
                            "object": last["object"],
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": oai.usage_of(finals),
                        }
                        tail.append(sse(usage))
                    tail.append(b"data: [DONE]\n\n")
                    # One write for the final events and the end of the body: one send instead of four.
                    await resp.write_eof(b"".join(tail))
            except PdclusterError as e:
                if not resp.prepared:
                    return error_response(e, headers)
                await resp.write(sse(oai.error_body(str(e), http_status_of(e))))
        if resp.prepared:
            await resp.write_eof()
        return resp
