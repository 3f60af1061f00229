"""OpenAI-compatible request schemas (msgspec) and response bodies, for ``/v1/completions`` and
``/v1/chat/completions``. The ``pdcluster`` key of a response is our extension: timing breakdown and served_by."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

from common.errors import InvalidRequestError
from pdcluster.v1 import common_pb2
from router.openai_fields import grammar_of, refuse_unsupported, unknown_field_error
from router.request import Final
from router.tool_calls import ToolPlan, plan_of


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's stream padding against side channels: none here, harmless


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = ""
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None  # enforced either way: the grammar allows only outputs that validate


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    request_id: str | None = None  # extension: the id to use (default: generated)
    priority: int | None = None  # extension (SGLang's): priority scheduling on the nodes
    # Constrained output (docs/structured-output.md): OpenAI's response_format, SGLang's regex / ebnf extensions and
    # vLLM's guided_* fields (router/openai_fields.py maps them).
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Harmless (openai_fields.HARMLESS): accepted, change nothing here.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Not served (openai_fields.REFUSED): a 400 naming the field unless it holds its no-op value; a field declared
    # nowhere is a 400 from forbid_unknown_fields. docs/api.md lists them.
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    chat_template_kwargs: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    lora_path: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, rendered by the chat template
    tool_call_id: str | None = None  # a tool turn: which call it answers
    name: str | None = None
    reasoning_content: str | None = None  # an earlier assistant turn's reasoning, for templates that render it
    # What an earlier response's message carries back (OpenAI SDKs resend it whole): nothing a template renders.
    refusal: str | None = None
    annotations: list[Any] | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


_DECODERS = {cls: msgspec.json.Decoder(cls) for cls in (CompletionRequest, ChatRequest)}


def decode(body: bytes, cls: type[CompletionRequest] | type[ChatRequest]) -> Any:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return _DECODERS[cls].decode(body)
    except RecursionError:
        raise InvalidRequestError("request body is nested too deeply") from None
    except msgspec.ValidationError as e:
        raise unknown_field_error(e) or InvalidRequestError(f"invalid request body: {e}") from e
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"request body is not valid JSON: {e}") from e


def _common_checks(r: _Common, max_n: int) -> None:
    refuse_unsupported(r)
    if r.n < 1 or r.n > max_n:
        raise InvalidRequestError(
            f"n must be between 1 and {max_n} on this router (--max-n), got {r.n}"
        )
    if r.best_of not in (None, 1):
        raise InvalidRequestError(f"best_of is not supported (must be 1), got {r.best_of}")
    if r.stream_options is not None and not r.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true")


def sampling_of(r: _Common, max_tokens: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": r.min_tokens,
        "ignore_eos": r.ignore_eos,
        "skip_special_tokens": r.skip_special_tokens,
        "seed": r.seed,
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    ):
        value = getattr(r, name)
        if value is not None:
            out[name] = value
    stop = r.stop
    out["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    out["stop_token_ids"] = tuple(r.stop_token_ids or ())
    out.update(grammar_of(r))
    if r.logit_bias:
        out["logit_bias"] = logit_bias_of(r.logit_bias)
    return out


def logit_bias_of(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` with the ids as integers (ranges are checked by ``SamplingParams.verify``)."""
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}") from None
    return out


def completion_inputs(r: CompletionRequest, max_n: int) -> dict[str, Any]:
    """Keyword arguments for ``InputProcessor.build``."""
    _common_checks(r, max_n)
    if r.echo:
        raise InvalidRequestError("echo is not supported; remove it")
    if r.suffix:
        raise InvalidRequestError("suffix is not supported; remove it")
    if r.logprobs is not None and not 0 <= r.logprobs <= 20:
        raise InvalidRequestError(f"logprobs must be in [0, 20], got {r.logprobs}")
    kw: dict[str, Any] = {}
    p = r.prompt
    if isinstance(p, list):
        if len(p) == 1 and isinstance(p[0], str | list):
            p = p[0]
        elif not p:
            raise InvalidRequestError("prompt must not be empty")
    if isinstance(p, str):
        kw["text"] = p
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        kw["input_ids"] = p
    else:
        raise InvalidRequestError(
            "prompt must be a string or a list of token ids (batches are not supported: send "
            "one prompt per request)"
        )
    lp = r.logprobs
    return {
        **kw,
        "sampling": sampling_of(r, r.max_tokens),
        "model": r.model,
        "stream": r.stream,
        "return_logprob": lp is not None,
        "top_logprobs_num": lp or 0,
        "priority": r.priority,
        "max_tokens_field": "max_tokens",
        "default_max_tokens": 16,
    }


def chat_inputs(r: ChatRequest, max_n: int, tool_call_parser: str | None = None) -> dict[str, Any]:
    _common_checks(r, max_n)
    plan = plan_of(r.tools, r.tool_choice, tool_call_parser)
    if r.parallel_tool_calls is False and plan is not None and plan.mode != "named":
        raise InvalidRequestError("parallel_tool_calls false is not supported; remove it (or name one function "
                                  "in tool_choice)")
    messages = []
    for i, m in enumerate(r.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}]: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.tool_calls is not None:
            msg["tool_calls"] = [_call_for_template(c) for c in m.tool_calls]
        for extra in ("tool_call_id", "name", "reasoning_content"):
            if getattr(m, extra) is not None:
                msg[extra] = getattr(m, extra)
        messages.append(msg)
    field, max_tokens = "max_tokens", r.max_tokens
    if r.max_completion_tokens is not None:
        field, max_tokens = "max_completion_tokens", r.max_completion_tokens
    if r.top_logprobs is not None and not r.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true")
    sampling = sampling_of(r, max_tokens)
    grammar = plan.grammar() if plan is not None else None
    if grammar is not None:
        if any(k in sampling for k in ("json_schema", "regex", "ebnf")):
            raise InvalidRequestError(f"tool_choice {plan.mode!r} constrains the output itself: remove "  # type: ignore[union-attr]
                                      "response_format / regex / ebnf")
        sampling["json_schema"] = grammar
    return {
        "messages": messages,
        "tools": list(plan.tools) if plan is not None else None,
        "tool_plan": plan,
        "sampling": sampling,
        "model": r.model,
        "stream": r.stream,
        "return_logprob": r.logprobs,
        "top_logprobs_num": r.top_logprobs or 0,
        "priority": r.priority,
        "max_tokens_field": field,
    }


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as chat templates expect it: arguments as an object, not JSON text."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError("messages[].tool_calls[] must be {\"type\": \"function\", \"function\": "
                                  "{\"name\", \"arguments\"}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise InvalidRequestError(f"messages[].tool_calls[].function.arguments is not JSON: {args[:64]!r}") from None
    return {**call, "function": {"name": fn["name"], "arguments": args}}


# -- responses -----------------------------------------------------------------------------------------------
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
