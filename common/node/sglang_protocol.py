"""SGLang's native ``/generate`` request and response shapes, converted to and from the node's own messages.

``parse_generate`` reads one JSON body (the one sglang-router sends to both the prefill and the decode node of a
pair: the client's body plus ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``) into an
``SglangRequest``; ``meta_info`` and ``finish_reason`` build SGLang's response fields from a node's ``TokenOut``.
Invalid input raises ``InvalidRequestError`` naming the field (HTTP 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from common.engine.io_struct import TokenOut
from common.engine.sampling.params import SamplingParams
from common.errors import InvalidRequestError

U64_LIMIT = 2**64  # bootstrap_room is a uint64 on our Worker API (sglang-router draws a u63)

# SGLang sampling_params name -> ours (same meaning). ``sampling_seed`` is SGLang's name of the per-request seed.
_SAMPLING_NAMES = {
    "max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
    "seed": "seed", "sampling_seed": "seed", "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf",
    "logit_bias": "logit_bias",
}
# SGLang sampling_params this node accepts only at their default (a different value would be silently ignored).
_SAMPLING_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "structural_tag": (None,),
    "no_stop_trim": (False, None), "spaces_between_special_tokens": (True, None), "custom_params": (None,),
    "stream_interval": (None,),
}
# Top-level fields with the same rule; fields not named here or below are ignored (routers add their own).
_TOP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "return_hidden_states": (False, None), "lora_path": (None,), "image_data": (None,), "audio_data": (None,),
    "video_data": (None,), "input_embeds": (None,), "session_params": (None,), "custom_logit_processor": (None,),
    "return_bytes": (False, None), "return_entropy": (False, None),
}


MAX_CHOICES = 16  # sampling_params.n: most choices one request may ask for


@dataclass(frozen=True)
class SglangRequest:
    """One parsed ``/generate`` body. Exactly one of ``text`` / ``input_ids`` is set."""

    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    stream: bool
    return_logprob: bool
    top_logprobs_num: int
    return_text_in_logprobs: bool
    rid: str | None
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None
    dp_rank: int | None  # routed_dp_rank / data_parallel_rank: this node's DP rank
    prefill_dp_rank: int | None  # disagg_prefill_dp_rank: decode nodes, the prefill DP rank holding the KV
    priority: int | None = None  # priority scheduling (a node without it refuses the request)
    n: int = 1  # sampling_params.n: choices, each its own request (``/generate`` on a colocated node)


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj


def _int_or_none(obj: dict[str, Any], name: str, lo: int = 0, hi: int = U64_LIMIT) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < hi:
        raise InvalidRequestError(f"{name} must be an integer in [{lo}, {hi}), got {value!r}")
    return value


def _bool(obj: dict[str, Any], name: str) -> bool:
    value = obj.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false, got {value!r}")
    return value


def _check_defaults(obj: dict[str, Any], allowed: dict[str, tuple[Any, ...]], where: str) -> None:
    for name, defaults in allowed.items():
        if name in obj and not any(obj[name] is d or obj[name] == d for d in defaults):
            raise InvalidRequestError(f"{where}{name}={obj[name]!r} is not supported by this node; leave it unset")


def sampling_from_sglang(sp: Any) -> SamplingParams:
    """SGLang ``sampling_params`` -> ours, verified (SGLang's defaults are ours: max_new_tokens 128, ...)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise InvalidRequestError(f"sampling_params must be an object, got {type(sp).__name__}")
    _check_defaults(sp, _SAMPLING_DEFAULTS, "sampling_params.")
    unknown = sorted(k for k in sp if k not in _SAMPLING_NAMES and k not in _SAMPLING_DEFAULTS)
    if unknown:
        raise InvalidRequestError(f"sampling_params has unknown field(s) {', '.join(unknown)}; SGLang's names are "
                                  f"{', '.join(sorted(_SAMPLING_NAMES))}")
    values: dict[str, Any] = {}
    for name, value in sp.items():
        ours = _SAMPLING_NAMES.get(name)
        if ours is None or value is None:
            continue
        if ours == "stop":
            value = (value,) if isinstance(value, str) else value
            if not isinstance(value, list | tuple):
                raise InvalidRequestError(f"sampling_params.stop must be a string or a list of strings, got {value!r}")
            value = tuple(value)
        elif ours == "stop_token_ids":
            if not isinstance(value, list | tuple):
                raise InvalidRequestError(f"sampling_params.stop_token_ids must be a list of ints, got {value!r}")
            value = tuple(value)
        elif ours == "logit_bias":
            if not isinstance(value, dict) or not all(isinstance(k, str) and k.lstrip("-").isdigit() for k in value):
                raise InvalidRequestError(f"sampling_params.logit_bias must map token ids to biases, got {value!r}")
            value = {int(k): v for k, v in value.items()}
        elif ours in ("ignore_eos", "skip_special_tokens") and not isinstance(value, bool):
            raise InvalidRequestError(f"sampling_params.{name} must be true or false, got {value!r}")
        elif ours in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                      "repetition_penalty") and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        values[ours] = value
    try:
        params = msgspec.structs.replace(SamplingParams(), **values)
    except TypeError as e:
        raise InvalidRequestError(f"sampling_params: {e}") from None
    params.verify()
    return params


def parse_generate(obj: dict[str, Any]) -> SglangRequest:
    """A ``/generate`` body -> ``SglangRequest`` (batches, i.e. a list ``text``, are refused: one request a call)."""
    _check_defaults(obj, _TOP_DEFAULTS, "")
    text, input_ids = obj.get("text"), obj.get("input_ids")
    if (text is None) == (input_ids is None):
        raise InvalidRequestError("send exactly one of text (a string) or input_ids (a list of token ids)")
    if text is not None and not isinstance(text, str):
        raise InvalidRequestError("text must be one string (batches are not supported: send one request per prompt)")
    if input_ids is not None and (
        not isinstance(input_ids, list) or not input_ids
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in input_ids)
    ):
        raise InvalidRequestError("input_ids must be a non-empty list of token ids (ints >= 0; one request a call)")
    if text == "":
        raise InvalidRequestError("text is empty; send at least one character")
    sp = obj.get("sampling_params")
    n = 1
    if isinstance(sp, dict) and "n" in sp:
        sp = dict(sp)
        n = sp.pop("n")
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise InvalidRequestError(f"sampling_params.n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    sampling = sampling_from_sglang(sp)
    top_n = _int_or_none(obj, "top_logprobs_num", 0, 1 << 16) or 0
    rid = obj.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise InvalidRequestError(f"rid must be a non-empty string, got {rid!r}")
    host = obj.get("bootstrap_host")
    if host is not None and (not isinstance(host, str) or not host):
        raise InvalidRequestError(f"bootstrap_host must be a host name or address, got {host!r}")
    dp_rank = _int_or_none(obj, "routed_dp_rank", 0, 1 << 16)
    if dp_rank is None:
        dp_rank = _int_or_none(obj, "data_parallel_rank", 0, 1 << 16)
    return SglangRequest(
        text=text, input_ids=input_ids, sampling=sampling, stream=_bool(obj, "stream"),
        return_logprob=_bool(obj, "return_logprob") or top_n > 0, top_logprobs_num=top_n,
        return_text_in_logprobs=_bool(obj, "return_text_in_logprobs"), rid=rid, bootstrap_host=host,
        bootstrap_port=_int_or_none(obj, "bootstrap_port", 1, 65536),
        bootstrap_room=_int_or_none(obj, "bootstrap_room"), dp_rank=dp_rank,
        prefill_dp_rank=_int_or_none(obj, "disagg_prefill_dp_rank", 0, 1 << 16),
        priority=_int_or_none(obj, "priority", -(1 << 63), 1 << 63), n=n,
    )


def finish_reason(out: TokenOut, max_new_tokens: int) -> dict[str, Any] | None:
    """SGLang's ``meta_info.finish_reason``: ``{"type": "length", "length": n}``, ``{"type": "stop", "matched":
    token id | string}`` or ``{"type": "abort", "message": ...}``; None while running."""
    if out.finish_reason is None:
        return None
    if out.finish_reason == "length":
        return {"type": "length", "length": max_new_tokens}
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    return {"type": "abort", "message": out.error or "aborted"}


class Logprobs:
    """Accumulated output logprobs in SGLang's shape: ``[logprob, token_id, text | None]`` per token, and per token
    the top ``top_logprobs_num`` as a list of the same triples."""

    def __init__(self, tokenizer: Any, with_text: bool) -> None:
        self.tokenizer = tokenizer
        self.with_text = with_text
        self.tokens: list[list[Any]] = []
        self.top: list[list[list[Any]]] = []

    def _triple(self, lp: float, tid: int) -> list[Any]:
        return [lp, tid, self.tokenizer.decode([tid]) if self.with_text else None]

    def add(self, out: TokenOut) -> None:
        self.tokens.extend(self._triple(lp, t) for lp, t in zip(out.logprobs, out.token_ids, strict=False))
        self.top.extend([self._triple(lp, t) for t, lp in pos] for pos in out.top_logprobs)

    def fields(self, top_n: int) -> dict[str, Any]:
        """Prompt logprobs are not computed by this engine: ``input_token_logprobs`` is empty."""
        out: dict[str, Any] = {"input_token_logprobs": [], "output_token_logprobs": list(self.tokens)}
        if top_n:
            out.update(input_top_logprobs=[], output_top_logprobs=list(self.top))
        return out
