"""The response to one request on a node's SGLang HTTP API: SGLang's ``/generate`` shape (``text``, ``output_ids``,
``meta_info``) or OpenAI's completion / chat shape, whole or as SSE (``data: {...}`` ... ``data: [DONE]``).

Text is detokenized incrementally with stop strings cut as our router cuts them; streamed ``/generate`` chunks carry
the cumulative ``text`` and ``output_ids`` (SGLang's default), OpenAI chunks the new text only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from common.engine.io_struct import PrefillDone, TokenOut
from common.node.sglang_openai import chat_body, chat_chunk, completion_body, completion_chunk
from common.node.sglang_protocol import Logprobs, SglangRequest, finish_reason
from common.serving.event_stream import delimit_event_stream
from common.speculative import accept_length
from common.text.detokenizer import IncrementalDetokenizer


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "code": status}, "object": "error", "message": message}
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


WRITE_TIMEOUT_S = 30.0  # a client that takes no bytes for this long is gone: its request is aborted


async def _write(resp: web.StreamResponse, data: bytes) -> None:
    async with asyncio.timeout(WRITE_TIMEOUT_S):  # no task per write, unlike wait_for
        await resp.write(data)


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class SglangResponse:
    """One request's response: SGLang's ``/generate`` shape or OpenAI's completion shape, whole or as SSE."""

    def __init__(self, tokenizer: Any, model_name: str, req: SglangRequest, rid: str, api: str,
                 include_usage: bool) -> None:
        self.model_name, self.req, self.rid, self.api, self.include_usage = model_name, req, rid, api, include_usage
        sp = req.sampling
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop)
        self.logprobs = Logprobs(tokenizer, req.return_text_in_logprobs)
        self.ids: list[int] = []
        self.started = time.monotonic()
        self.created = int(time.time())
        self.last: TokenOut | PrefillDone | None = None
        self.sent_role = False  # chat streams: the first chunk's delta carries the role

    def _add(self, out: TokenOut | PrefillDone) -> str:
        """Take one output; returns the text it made final."""
        self.last = out
        if isinstance(out, PrefillDone):
            return ""
        self.ids.extend(out.token_ids)
        self.logprobs.add(out)
        return self.detok.add(out.token_ids, final=out.finish_reason is not None)

    def _meta(self) -> dict[str, Any]:
        out = self.last
        meta: dict[str, Any] = {"id": self.rid, "finish_reason": None, "prompt_tokens": 0,
                                "completion_tokens": len(self.ids), "cached_tokens": 0,
                                "e2e_latency": time.monotonic() - self.started}
        if isinstance(out, PrefillDone):
            meta.update(finish_reason={"type": "length", "length": 0}, prompt_tokens=out.prompt_tokens,
                        cached_tokens=out.cached_tokens)
        elif out is not None:
            meta.update(finish_reason=finish_reason(out, self.req.sampling.max_new_tokens),
                        prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens)
            if out.finish_reason is not None:
                meta["completion_tokens"] = out.completion_tokens
                if out.spec_verify_ct:  # SGLang's names
                    meta.update(spec_verify_ct=out.spec_verify_ct,
                                spec_accept_length=accept_length(out.spec_verify_ct, out.spec_accepted_tokens))
        if self.req.return_logprob:
            meta.update(self.logprobs.fields(self.req.top_logprobs_num))
        return meta

    def _body(self) -> dict[str, Any]:
        if self.api == "completions":
            return completion_body(self.rid, self.model_name, self.created, self.detok.text, self._meta())
        if self.api == "chat":
            return chat_body(self.rid, self.model_name, self.created, self.detok.text, self._meta())
        return {"text": self.detok.text, "output_ids": list(self.ids), "meta_info": self._meta()}

    async def full(self, outputs: AsyncIterator[TokenOut | PrefillDone]) -> dict[str, Any]:
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                self._add(out)
        return self._body()

    async def stream(self, request: web.Request, outputs: AsyncIterator[TokenOut | PrefillDone]) -> web.StreamResponse:
        """Headers go out with the first output, so a failure before it is a real HTTP status."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-ID": self.rid})
        delimit_event_stream(resp, request)
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    delta = self._add(out)
                    finished = isinstance(out, PrefillDone) or out.finish_reason is not None
                    if not resp.prepared:
                        await resp.prepare(request)
                    if not finished and not delta and not (self.req.return_logprob and out.token_ids):
                        continue
                    usage = self.include_usage and finished
                    if self.api == "completions":
                        await _write(resp, _sse(completion_chunk(self.rid, self.model_name, self.created, delta,
                                                               self._meta(), usage)))
                    elif self.api == "chat":
                        role = {"role": "assistant"} if not self.sent_role else {}
                        self.sent_role = True
                        await _write(resp, _sse(chat_chunk(self.rid, self.model_name, self.created,
                                                         {**role, "content": delta}, self._meta(), usage)))
                    else:
                        await _write(resp, _sse(self._body()))
                await _write(resp, b"data: [DONE]\n\n")
            except HttpError as e:
                if not resp.prepared:
                    return error_response(e.status, str(e))
                await _write(resp, _sse({"error": {"message": str(e), "code": e.status}}))
        await resp.write_eof()
        return resp


async def full_choices(runs: list[SglangResponse], outputs: list[AsyncIterator[TokenOut | PrefillDone]]
                       ) -> list[dict[str, Any]]:
    """n choices' whole bodies, in choice order; the first failure cancels the others (their requests abort)."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(run.full(outs)) for run, outs in zip(runs, outputs, strict=True)]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    return [dict(t.result(), index=i) for i, t in enumerate(tasks)]


async def stream_choices(request: web.Request, rid: str, runs: list[SglangResponse],
                         outputs: list[AsyncIterator[TokenOut | PrefillDone]]) -> web.StreamResponse:
    """n choices as one SSE stream: each event is a choice's cumulative ``/generate`` body with its ``index``, as
    its outputs come; ``[DONE]`` after the last choice ends. A failure ends the stream with an error event."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-ID": rid})
    delimit_event_stream(resp, request)
    events: asyncio.Queue[tuple[int, dict[str, Any]] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, run: SglangResponse, outs: AsyncIterator[TokenOut | PrefillDone]) -> None:
        try:
            async with contextlib.aclosing(outs):
                async for out in outs:
                    run._add(out)
                    events.put_nowait((i, dict(run._body(), index=i)))
        except Exception as e:  # the request fails with it
            events.put_nowait(e)
        else:
            events.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, run, outs)) for i, (run, outs) in enumerate(zip(runs, outputs, strict=True))]
    try:
        left = len(tasks)
        while left:
            ev = await events.get()
            if ev is None:
                left -= 1
                continue
            if isinstance(ev, BaseException):
                status = ev.status if isinstance(ev, HttpError) else 500
                if not resp.prepared:
                    return error_response(status, str(ev))
                await _write(resp, _sse({"error": {"message": str(ev), "code": status}}))
                break
            if not resp.prepared:
                await resp.prepare(request)
            await _write(resp, _sse(ev[1]))
        else:
            await _write(resp, b"data: [DONE]\n\n")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await resp.write_eof()
    return resp
