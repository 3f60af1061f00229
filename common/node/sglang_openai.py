"""``/v1/completions`` on a node's SGLang HTTP API: sglang-router forwards the client's OpenAI body (plus
``bootstrap_*``) to both nodes of a pair; it is mapped onto the ``/generate`` request and answered in OpenAI's
completion shape (``choices[0].text``, ``finish_reason``, ``usage``; SSE chunks then ``data: [DONE]``)."""

from __future__ import annotations

import json
from typing import Any

from common.errors import InvalidRequestError

# OpenAI completion field -> SGLang sampling_params name
_SAMPLING = {
    "max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "temperature": "temperature", "top_p": "top_p",
    "top_k": "top_k", "min_p": "min_p", "stop": "stop", "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "seed": "sampling_seed", "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim", "n": "n", "regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf",
    "logit_bias": "logit_bias",
}
_PASSED = ("stream", "rid", "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank",
           "data_parallel_rank", "disagg_prefill_dp_rank", "lora_path", "return_hidden_states", "priority")
DEFAULT_MAX_TOKENS = 16  # OpenAI's
# Fields that would change the result and are not served: refused, never dropped.
_REFUSED = ("tools", "tool_choice", "functions", "function_call")


def _response_format(fmt: Any) -> dict[str, str]:
    """OpenAI ``response_format`` -> the sampling field enforcing it."""
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    schema = (fmt.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    if kind == "json_schema" and isinstance(schema, dict | bool):
        return {"json_schema": json.dumps(schema)}
    raise InvalidRequestError('response_format must be {"type": "text" | "json_object"} or {"type": "json_schema", '
                              f'"json_schema": {{"schema": {{...}}}}}}, got {fmt!r}')


def completion_to_generate(obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """An OpenAI completion body -> a ``/generate`` body, and whether the stream ends with a usage chunk."""
    if obj.get("echo"):
        raise InvalidRequestError("echo=true is not supported by this node")
    if obj.get("suffix") is not None:
        raise InvalidRequestError("suffix is not supported by this node")
    prompt = obj.get("prompt")
    gen: dict[str, Any] = {k: obj[k] for k in _PASSED if k in obj}
    if isinstance(prompt, str):
        gen["text"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        gen["input_ids"] = prompt
    elif isinstance(prompt, list) and len(prompt) == 1:
        gen["text" if isinstance(prompt[0], str) else "input_ids"] = prompt[0]
    else:
        raise InvalidRequestError("prompt must be one string or one list of token ids (one prompt a request)")
    sp = {ours: obj[name] for name, ours in _SAMPLING.items() if obj.get(name) is not None}
    sp.setdefault("max_new_tokens", DEFAULT_MAX_TOKENS)
    sp.update(_response_format(obj.get("response_format")))
    if obj.get("best_of") not in (None, 1):
        raise InvalidRequestError(f"best_of must be 1 on this node, got {obj.get('best_of')!r}")
    for name in _REFUSED:
        if obj.get(name) is not None:
            raise InvalidRequestError(f"{name} is not supported by this node; remove it")
    gen["sampling_params"] = sp
    top = obj.get("logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise InvalidRequestError(f"logprobs must be an integer in [0, 20], got {top!r}")
        gen.update(return_logprob=True, top_logprobs_num=top, return_text_in_logprobs=True)
    options = obj.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequestError(f"stream_options must be an object, got {options!r}")
    return gen, bool(options.get("include_usage"))


def _finish(meta: dict[str, Any]) -> tuple[str | None, Any]:
    reason = meta.get("finish_reason")
    if reason is None:
        return None, None
    return reason["type"], reason.get("matched")


def _usage(meta: dict[str, Any]) -> dict[str, Any]:
    p, c = meta["prompt_tokens"], meta["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": meta["cached_tokens"]}}


def _logprobs(meta: dict[str, Any]) -> dict[str, Any] | None:
    if "output_token_logprobs" not in meta:
        return None
    tokens = meta["output_token_logprobs"]
    tops = meta.get("output_top_logprobs")
    offsets, at = [], 0
    for _, _, text in tokens:
        offsets.append(at)
        at += len(text or "")
    return {"tokens": [t[2] for t in tokens], "token_logprobs": [t[0] for t in tokens],
            "top_logprobs": [{t[2]: t[0] for t in pos} for pos in tops] if tops else None, "text_offset": offsets}


def completion_body(rid: str, model: str, created: int, text: str, meta: dict[str, Any]) -> dict[str, Any]:
    reason, matched = _finish(meta)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": _logprobs(meta), "finish_reason": reason,
                         "matched_stop": matched}],
            "usage": _usage(meta)}


def completion_chunk(rid: str, model: str, created: int, delta: str, meta: dict[str, Any],
                     with_usage: bool) -> dict[str, Any]:
    """One SSE chunk: the new text; the last one carries ``finish_reason`` (and ``usage`` when asked for)."""
    reason, matched = _finish(meta)
    chunk: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": reason,
                                          "matched_stop": matched}]}
    if with_usage:
        chunk["usage"] = _usage(meta)
    return chunk


def chat_to_generate(obj: dict[str, Any]) -> tuple[dict[str, Any], bool, list[dict[str, str]]]:
    """An OpenAI chat body -> a ``/generate`` body without its prompt (the caller renders ``messages`` through the
    model's chat template into ``input_ids``), whether the stream ends with usage, and the text-only messages."""
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("messages must be a non-empty list of {role, content}")
    messages = []
    for i, m in enumerate(raw):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidRequestError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str | None):
            raise InvalidRequestError(f"messages[{i}] must be {{role: string, content: string}}")
        messages.append({"role": m["role"], "content": content or ""})
    body = {k: v for k, v in obj.items() if k not in ("messages", "logprobs", "top_logprobs", "max_tokens")}
    body["prompt"] = ""  # replaced by the rendered ids
    gen, usage = completion_to_generate(body)
    gen.pop("text", None)
    limit = obj.get("max_completion_tokens", obj.get("max_tokens"))
    gen["sampling_params"]["max_new_tokens"] = limit if limit is not None else 128  # SGLang's default
    if obj.get("logprobs"):
        top = obj.get("top_logprobs") or 0
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise InvalidRequestError(f"top_logprobs must be an integer in [0, 20], got {top!r}")
        gen.update(return_logprob=True, top_logprobs_num=top, return_text_in_logprobs=True)
    return gen, usage, messages


def chat_body(rid: str, model: str, created: int, text: str, meta: dict[str, Any]) -> dict[str, Any]:
    reason, matched = _finish(meta)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": reason, "matched_stop": matched}],
            "usage": _usage(meta)}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, str], meta: dict[str, Any],
               with_usage: bool) -> dict[str, Any]:
    reason, matched = _finish(meta)
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason,
                                          "matched_stop": matched}]}
    if with_usage:
        chunk["usage"] = _usage(meta)
    return chunk
