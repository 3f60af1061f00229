"""The router's internal request and result types, shared by the gRPC service and the HTTP gateway."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from common.engine.sampling.params import SamplingParams
from pdcluster.v1 import common_pb2


@dataclass(slots=True, kw_only=True)
class ClientRequest:
    """A request as a client API decoded it, before validation and tokenization (``InputProcessor.build``).
    Exactly one of ``text``, ``input_ids``, ``messages``; ``sampling`` holds ``SamplingParams`` fields, where
    ``max_new_tokens`` None means the default (clamped to the context)."""

    rid: str
    api: str  # "grpc", "completions" or "chat" (a metrics label)
    sampling: dict[str, Any]
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # chat: function definitions for the chat template
    model: str = ""
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    timeout_s: float | None = None  # the client's own deadline, if it sent one
    max_tokens_field: str = "max_tokens"  # the API's name for max_new_tokens, in error messages
    default_max_tokens: int | None = None  # None: "up to the context" (chat)
    priority: int | None = None  # priority scheduling on the nodes (None: the least urgent)
    authorization: str | None = None  # the client's bearer: its priority ceiling (router/intake/priority_policy.py)


@dataclass(slots=True)
class RoutePin:
    """Where the choices of one ``n > 1`` request go (``router.choices``): the first one routed records its workers
    and DP ranks, the others follow while those can take them."""

    picks: list[tuple[Any, int]] = field(default_factory=list)  # (``Worker``, DP rank): P then D, or one colocated


@dataclass(slots=True)
class GenRequest:
    """A validated, tokenized request. ``deadline`` and ``arrival`` are ``time.monotonic()`` values."""

    rid: str
    api: str  # "grpc", "completions" or "chat" (a metrics label)
    input_ids: list[int]
    sampling: SamplingParams
    sampling_pb: common_pb2.SamplingParams
    stream: bool
    arrival: float
    deadline: float
    return_logprob: bool = False
    top_logprobs_num: int = 0
    tokenize_s: float = 0.0
    priority: int | None = None  # forwarded to both legs
    pin: RoutePin | None = None  # the choices of one ``n > 1`` request share one (same workers, same DP ranks)
    delta_sink: DeltaSink | None = None  # streaming: where a delta can go at once, from the node's message callback

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens


class DeltaSink(Protocol):
    """A client stream that can take a delta synchronously (the HTTP gateway's SSE writer, a streamed gRPC Generate's
    writer). An attempt gives it the deltas of the tokens a leg's sink took while the request's task waited
    (``router/attempts/run.py``); the others, and every delta while ``ready`` is False, still go through the request's
    event stream, in order."""

    def ready(self) -> bool: ...

    def write(self, delta: Delta) -> None: ...


@dataclass(slots=True)
class Delta:
    """New output since the last Delta: text that became final (may be empty) and the token ids that arrived."""

    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class Final:
    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    served_by: str
    timing: dict[str, Any]  # router/attempts/output.py ``OutputState.finish`` documents the keys
    matched_token: int | None = None
    matched_stop: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)
    node_timing: common_pb2.Timing | None = None  # merged P + D timing with router-measured ttft/e2e
    spec: common_pb2.SpecDecoding | None = None  # speculative decoding on the (last) decode node, when it speculated


def sampling_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    out = common_pb2.SamplingParams(
        max_new_tokens=sp.max_new_tokens,
        min_new_tokens=sp.min_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos,
        seed=sp.seed,
        skip_special_tokens=sp.skip_special_tokens,
    )
    key = sp.grammar_key
    if key is not None:
        setattr(out, key[0], key[1])  # the oneof ``constraint``
    if sp.logit_bias:
        out.logit_bias.update(sp.logit_bias)
    return out
