"""OpenAI-compatible response bodies and stream chunks for ``/v1/completions`` and ``/v1/chat/completions``: usage,
logprobs, tool calls read from a finished output, errors. The ``pdcluster`` key of a response is our extension:
timing breakdown and served_by."""

from __future__ import annotations

import time
from typing import Any

from pdcluster.v1 import common_pb2
from router.openai.tool_calls import ToolPlan
from router.request import Final


def usage_of(finals: list[Final]) -> dict[str, Any]:
    """One request's usage over its choices: the prompt counts once (it is the same for every choice)."""
    prompt = finals[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": finals[0].cached_tokens},
    }


def extension_of(f: Final) -> dict[str, Any]:
    ext: dict[str, Any] = {"timing": f.timing, "served_by": f.served_by}
    if f.spec is not None:
        s = f.spec
        ext["spec_decoding"] = {"verify_steps": s.verify_steps, "draft_tokens": s.draft_tokens,
                                "accepted_tokens": s.accepted_tokens, "accept_length": s.accept_length}
    if f.matched_stop is not None:
        ext["matched_stop"] = f.matched_stop
    elif f.matched_token is not None:
        ext["matched_token"] = f.matched_token
    return ext


class LogprobFormatter:
    """Token strings for logprobs, from the tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def token(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False)

    def chat(self, ids: list[int], lps: list[float], tops: list[common_pb2.TopLogprobs]) -> dict[str, Any]:
        content = []
        for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
            s = self.token(tid)
            top = tops[i] if i < len(tops) else None
            content.append(
                {
                    "token": s,
                    "logprob": lp,
                    "bytes": list(s.encode()),
                    "top_logprobs": []
                    if top is None
                    else [
                        {"token": (t := self.token(a)), "logprob": b, "bytes": list(t.encode())}
                        for a, b in zip(top.token_ids, top.logprobs, strict=False)
                    ],
                }
            )
        return {"content": content}

    def completion(
        self, ids: list[int], lps: list[float], tops: list[common_pb2.TopLogprobs], offset: int
    ) -> dict[str, Any]:
        tokens = [self.token(t) for t in ids[: len(lps)]]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        top = (
            [{self.token(a): b for a, b in zip(t.token_ids, t.logprobs, strict=False)} for t in tops]
            if tops
            else None
        )
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def put_tool_calls(body: dict[str, Any], plan: ToolPlan, text: str, index: int = 0) -> None:
    """A finished chat body's choice ``index`` read into ``tool_calls`` when its output holds any: finish_reason
    "tool_calls", or "length" for calls cut by max_tokens (returned partial)."""
    content, calls = plan.parse(text)
    if not calls:
        return
    choice = body["choices"][index]
    choice["message"]["content"] = content
    choice["message"]["tool_calls"] = [c.to_openai() for c in calls]
    if choice["finish_reason"] == "stop":
        choice["finish_reason"] = "tool_calls"


def tool_call_delta(plan: ToolPlan, text: str, sent: int, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The last streamed delta of a chat with tools: the held-back text as tool calls (or content) and the
    finish reason."""
    _, calls = plan.parse(text)
    if not calls:
        return ({"content": text[sent:]} if text[sent:] else {}), finish
    return ({"tool_calls": [c.to_openai(index=i) for i, c in enumerate(calls)]},
            "tool_calls" if finish == "stop" else finish)


Choice = tuple[str, str | None, dict[str, Any] | None]  # one choice of a full body: text, finish reason, logprobs


def completion_body(rid: str, model: str, created: int, choices: list[Choice]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
                    for i, (text, finish, lp) in enumerate(choices)],
    }


def chat_body(rid: str, model: str, created: int, choices: list[Choice]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": finish}
            for i, (text, finish, lp) in enumerate(choices)
        ],
    }


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish: str | None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }


def completion_chunk(
    rid: str, model: str, created: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }


def error_body(message: str, status: int, code: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code or str(status)}}


def now_s() -> int:
    return int(time.time())
