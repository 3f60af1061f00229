"""Input processing: model check, tokenization (text, token ids or chat messages), sampling-param validation.

Every rejection is an ``InvalidRequestError`` (or ``CapacityError`` for context overflow) whose message names the
field as the client spelled it (``max_tokens`` on the OpenAI API, ``sampling_params.max_new_tokens`` on gRPC).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from common.engine.sampling.params import SamplingParams
from common.errors import CapacityError, InvalidRequestError
from router.request import ClientRequest, GenRequest, sampling_to_proto
from router.tokenizer.messages import ChatMessage, TokenizeJob
from router.tokenizer.pool import TokenizePool
from router.tokenizer.tokenizer import Tokenizer

REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


FLOAT32_MAX = 3.4028234663852886e38
INT64_MAX = (1 << 63) - 1


def check_numeric_ranges(sampling: dict[str, Any]) -> None:
    """Every number must survive the trip to a node: finite float32 for floats, int64 for integers."""
    for name, value in sampling.items():
        values = value if isinstance(value, list | tuple) else (value,)
        for v in values:
            if isinstance(v, float) and not (math.isfinite(v) and abs(v) <= FLOAT32_MAX):
                raise InvalidRequestError(f"{name} must be a finite number of at most {FLOAT32_MAX:.3g}, got {v}")
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT64_MAX:
                raise InvalidRequestError(f"{name} is out of range: {v}")


def check_request_id(rid: str) -> None:
    """Request ids travel into headers, logs and node RPCs: 1-128 characters of ``[A-Za-z0-9._:@/+=-]``."""
    if not REQUEST_ID.fullmatch(rid):
        raise InvalidRequestError(f"request_id must be 1-128 characters of letters, digits and ._:@/+=- "
                                  f"(got {len(rid)} characters, starting {rid[:16]!r})")

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_TOP_LOGPROBS = 20
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # priority travels as a protobuf int32


def config_context_len(model_path: Path) -> int | None:
    try:
        cfg = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        if isinstance(cfg.get(key), int) and cfg[key] > 0:
            return int(cfg[key])
    return None


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        config_context_len: int | None,
        default_max_tokens: int,
        request_timeout_s: float,
        pool: TokenizePool | None = None,
        inline_bytes: int = 0,
    ) -> None:
        """``pool``: where inputs over ``inline_bytes`` (UTF-8 bytes of text, or of all message contents) are
        tokenized; None tokenizes everything inline."""
        self.tok = tokenizer
        self.pool = pool
        self.inline_bytes = inline_bytes
        self.max_bytes_per_token = tokenizer.max_bytes_per_token()
        self.model_name = model_name
        self.config_context_len = config_context_len
        self.worker_context_len: int | None = None  # from the workers' GetServerInfo, when known
        self.default_max_tokens = default_max_tokens
        self.request_timeout_s = request_timeout_s

    @property
    def context_len(self) -> int | None:
        return self.worker_context_len or self.config_context_len

    @property
    def max_prompt_bytes(self) -> int | None:
        """Prompts longer than this (UTF-8 bytes) cannot fit the context whatever they say: refused untokenized."""
        ctx = self.context_len
        if ctx is None or self.max_bytes_per_token is None:
            return None
        return ctx * self.max_bytes_per_token

    async def build(self, c: ClientRequest) -> GenRequest:
        """Validate and tokenize ``c``: a ``GenRequest``, or a typed error saying what to fix."""
        arrival = time.monotonic()
        check_request_id(c.rid)
        if c.model and c.model != self.model_name:
            raise InvalidRequestError(
                f"model: {c.model!r} is not served here; available models: [{self.model_name!r}]"
            )
        timeout = self.request_timeout_s if c.timeout_s is None else min(c.timeout_s, self.request_timeout_s)
        ids = await self._tokenize(c.text, c.input_ids, c.messages, arrival + timeout, c.tools)
        tokenize_s = time.monotonic() - arrival

        ctx = self.context_len
        n = len(ids)
        if ctx is not None and n >= ctx:
            raise CapacityError(
                f"prompt: {n} tokens, but the model's context is {ctx} tokens "
                "(one more is needed to generate); shorten the prompt"
            )
        sampling, max_tokens_field = c.sampling, c.max_tokens_field
        max_new = sampling.get("max_new_tokens")
        if max_new is None:
            room = (ctx - n) if ctx is not None else self.default_max_tokens
            want = self.default_max_tokens if c.default_max_tokens is None else c.default_max_tokens
            sampling["max_new_tokens"] = max(1, min(want, room)) if c.api != "chat" else max(1, room)
        else:
            if isinstance(max_new, bool) or not isinstance(max_new, int):
                raise InvalidRequestError(f"{max_tokens_field} must be an integer, got {max_new!r}")
            if max_new <= 0:
                raise InvalidRequestError(f"{max_tokens_field} must be >= 1, got {max_new}")
            if ctx is not None and n + max_new > ctx:
                raise CapacityError(
                    f"{max_tokens_field}: prompt ({n} tokens) + {max_tokens_field} ({max_new}) = "
                    f"{n + max_new} exceeds the model's context of {ctx} tokens; lower {max_tokens_field}"
                )
        if c.top_logprobs_num < 0 or c.top_logprobs_num > MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {c.top_logprobs_num}"
            )
        check_numeric_ranges(sampling)
        try:
            sp = SamplingParams(**sampling)
        except TypeError as e:
            raise InvalidRequestError(f"sampling parameters: {e}") from e
        sp.verify(self.tok.vocab_size)
        if c.priority is not None and (isinstance(c.priority, bool) or not INT32_MIN <= c.priority <= INT32_MAX):
            raise InvalidRequestError(f"priority must be an integer in [{INT32_MIN}, {INT32_MAX}], got {c.priority!r}")

        return GenRequest(
            rid=c.rid,
            api=c.api,
            input_ids=ids,
            sampling=sp,
            sampling_pb=sampling_to_proto(sp),
            stream=c.stream,
            arrival=arrival,
            deadline=arrival + timeout,
            return_logprob=c.return_logprob or c.top_logprobs_num > 0,
            top_logprobs_num=c.top_logprobs_num,
            tokenize_s=tokenize_s,
            priority=c.priority,
        )

    async def _tokenize(
        self,
        text: str | None,
        input_ids: list[int] | None,
        messages: list[dict[str, Any]] | None,
        deadline: float,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        given = sum(x is not None for x in (text, input_ids, messages))
        if given != 1:
            raise InvalidRequestError("exactly one of prompt text, input_ids or messages is required")
        if text is not None:
            if not text:
                raise InvalidRequestError("prompt must not be empty")
            nbytes = self._check_bytes("prompt", utf8_len(text))
            if self.pool is not None and nbytes > self.inline_bytes:
                ids = await self.pool.tokenize(TokenizeJob(text=text), deadline)
            else:
                ids = self.tok.encode(text)
            if not ids:
                raise InvalidRequestError("prompt encodes to no tokens")
            return ids
        if input_ids is not None:
            if not input_ids:
                raise InvalidRequestError("input_ids (prompt token ids) must not be empty")
            vocab = self.tok.vocab_size
            for i, t in enumerate(input_ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise InvalidRequestError(f"input_ids[{i}] = {t!r} is not a token id in [0, {vocab})")
            return list(input_ids)
        assert messages is not None
        if not messages:
            raise InvalidRequestError("messages must not be empty")
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}"
                )
            if not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}].content must be a string")
        if not self.tok.has_chat_template:
            raise InvalidRequestError(
                "messages: this model has no chat template; send a prompt to /v1/completions"
            )
        nbytes = self._check_bytes("messages", sum(utf8_len(m["content"]) for m in messages))
        # NOTE: tools and tool turns render inline (the pool's jobs carry role and content only).
        plain = not tools and all(m.keys() <= {"role", "content"} for m in messages)
        if self.pool is not None and nbytes > self.inline_bytes and plain:
            job = TokenizeJob(messages=[ChatMessage(m["role"], m["content"]) for m in messages])
            ids = await self.pool.tokenize(job, deadline)
        else:
            ids = self.tok.encode_chat(messages, tools)
        if not ids:
            raise InvalidRequestError("messages render to no tokens")
        return ids

    def _check_bytes(self, field: str, nbytes: int) -> int:
        limit = self.max_prompt_bytes
        if limit is not None and nbytes > limit:
            raise CapacityError(
                f"{field}: {nbytes} bytes cannot fit the model's context of {self.context_len} tokens (this "
                f"tokenizer's tokens stand for at most {self.max_bytes_per_token} bytes each: a limit of {limit} "
                "bytes); shorten the prompt"
            )
        return nbytes


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
