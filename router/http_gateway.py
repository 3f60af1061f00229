"""OpenAI-compatible HTTP gateway (aiohttp) over ``RouterService``.

Streaming responses send their headers only with the first output, so every failure before the first token (after
the router's retries) is a real HTTP status (400/503/504) rather than an error inside a 200 stream. A client that
disconnects cancels its handler (``handler_cancellation``), which aborts both legs on the workers.
"""

from __future__ import annotations

import contextlib
import math
import uuid
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from common.errors import PdclusterError
from router import openai_protocol as oai
from router.admin import admin_middleware
from router.client_auth import api_key_middleware
from router.errors import http_status_of, retry_after_of
from router.request import ClientRequest, Delta, Final
from router.service import RouterService
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


def _sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class HttpGateway:
    def __init__(self, service: RouterService) -> None:
        self.service = service
        self.logprobs = oai.LogprobFormatter(service.core.tokenizer_hf)
        middlewares = [admin_middleware(service.cfg.admin_token)]
        if service.cfg.api_key:
            middlewares.insert(0, api_key_middleware(service.cfg.api_key))
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
            rid = request.headers.get("X-Request-ID") or parsed.request_id or prefix + uuid.uuid4().hex[:24]
            req = await svc.build(ClientRequest(rid=rid, api=api, **kw))
        except PdclusterError as e:
            return error_response(e)
        headers = {"X-Request-ID": rid}
        model = svc.model_name
        created = oai.now_s()
        if not req.stream:
            final: Final | None = None
            try:
                async with contextlib.aclosing(svc.generate(req)) as events:
                    async for ev in events:
                        if isinstance(ev, Final):
                            final = ev
            except PdclusterError as e:
                return error_response(e, headers)
            assert final is not None
            body = self._full_body(api, final, model, created, req.top_logprobs_num, req.return_logprob)
            if plan is not None:
                oai.put_tool_calls(body, plan, final.text)
            return json_response(body, headers=headers)
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return await self._stream(
            request,
            api,
            req.rid,
            model,
            created,
            req.return_logprob,
            include_usage,
            headers,
            svc.generate(req),
            plan,
        )

    def _full_body(
        self, api: str, f: Final, model: str, created: int, top_n: int, want_lp: bool
    ) -> dict[str, Any]:
        lp = None
        if want_lp:
            lp = (
                self.logprobs.chat(f.output_ids, f.logprobs, f.top_logprobs)
                if api == "chat"
                else self.logprobs.completion(f.output_ids, f.logprobs, f.top_logprobs if top_n else [], 0)
            )
        make = oai.chat_body if api == "chat" else oai.completion_body
        body = make(f.rid, model, created, f.text, f.finish_reason, lp)
        body["usage"] = oai.usage_of(f)
        body["pdcluster"] = oai.extension_of(f)
        return body

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
        events: Any,
        plan: ToolPlan | None = None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        chat = api == "chat"
        offset = 0
        text, sent = "", 0  # with tools: the output so far, and how much of it went out as content
        async with contextlib.aclosing(events):
            try:
                async for ev in events:
                    if not resp.prepared:
                        await resp.prepare(request)
                        if chat:
                            await resp.write(
                                _sse(
                                    oai.chat_chunk(
                                        rid, model, created, {"role": "assistant", "content": ""}, None
                                    )
                                )
                            )
                    if isinstance(ev, Delta):
                        lp = None
                        if want_lp:
                            lp = (
                                self.logprobs.chat(ev.token_ids, ev.logprobs, ev.top_logprobs)
                                if chat
                                else self.logprobs.completion(
                                    ev.token_ids, ev.logprobs, ev.top_logprobs, offset
                                )
                            )
                        offset += len(ev.text)
                        piece = ev.text
                        if plan is not None:  # a tool call's text is held until the output ends
                            text += ev.text
                            upto = max(sent, plan.holds_back(text))
                            piece, sent = text[sent:upto], upto
                        if not piece and lp is None:
                            continue
                        chunk = (
                            oai.chat_chunk(rid, model, created, {"content": piece}, None, lp)
                            if chat
                            else oai.completion_chunk(rid, model, created, ev.text, None, lp)
                        )
                        await resp.write(_sse(chunk))
                    else:
                        finish, delta = ev.finish_reason, {}
                        if plan is not None:
                            delta, finish = oai.tool_call_delta(plan, text, sent, finish)
                        last = (
                            oai.chat_chunk(rid, model, created, delta, finish)
                            if chat
                            else oai.completion_chunk(rid, model, created, "", ev.finish_reason)
                        )
                        last["pdcluster"] = oai.extension_of(ev)
                        tail = [_sse(last)]
                        if include_usage:
                            usage = {
                                "id": rid,
                                "object": last["object"],
                                "created": created,
                                "model": model,
                                "choices": [],
                                "usage": oai.usage_of(ev),
                            }
                            tail.append(_sse(usage))
                        tail.append(b"data: [DONE]\n\n")
                        # One write for the final events and the end of the body: one send instead of four.
                        await resp.write_eof(b"".join(tail))
            except PdclusterError as e:
                if not resp.prepared:
                    return error_response(e, headers)
                await resp.write(_sse(oai.error_body(str(e), http_status_of(e))))
        if resp.prepared:
            await resp.write_eof()
        return resp
