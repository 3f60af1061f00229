"""``RequestIntake``: taking a request in on a rank — what makes it servable here (vocabulary, context, KV
capacity), the ``Req`` it becomes (``max_new_tokens`` clamped to the context), and its registration under its rid
until it finishes (``reqs_by_rid``). The roles' first queues (bootstrap, prealloc, the colocated waiting queue) all
take requests in through ``RequestIntake.build_req``; a request with a grammar first waits in the grammar queue
(``hold_for_grammar``) until every rank has compiled its grammar.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from common.engine.io_struct import GenerateReqInput
from common.engine.model.config import ModelConfig
from common.engine.req import Req
from common.engine.scheduler_output import OutputCollector
from common.errors import CapacityError, ErrorCode, InvalidRequestError, internal_error_message
from common.faults import inject

if TYPE_CHECKING:
    from common.engine.sampling.grammar_queue import GrammarQueue

logger = logging.getLogger(__name__)


class RequestIntake:
    def __init__(self, model_config: ModelConfig, max_total_num_tokens: int, out: OutputCollector,
                 request_log_level: int,
                 resolve_priority: Callable[[int | None], int],
                 grammar_matcher: Callable[[tuple[str, str]], Any] | None = None) -> None:
        self.model_config = model_config
        self.max_total_num_tokens = max_total_num_tokens
        self.out = out
        self.reqs_by_rid: dict[str, Req] = {}  # a request is in flight from ``build_req`` to ``Scheduler.finish_req``
        self.request_log_level = request_log_level
        # The priority a request runs with; raises InvalidRequestError for one this node does not schedule by
        # (``SchedulePolicy.resolve_priority``).
        self.resolve_priority = resolve_priority
        # A fresh matcher (``common.engine.sampling.grammar.RequestGrammar``) over a compiled grammar key; the
        # scheduler holds a request with a grammar in its grammar queue until the key is compiled.
        self.grammar_matcher = grammar_matcher

    def find(self, rid: str) -> Req | None:
        """The request in flight on this rank under ``rid``."""
        return self.reqs_by_rid.get(rid)

    def validate(self, msg: GenerateReqInput) -> None:
        """Raise a typed error saying what to fix if the request can never be served here."""
        sp = msg.sampling_params
        sp.verify(self.model_config.vocab_size)
        self.resolve_priority(msg.priority)
        n = len(msg.input_ids)
        if n == 0:
            raise InvalidRequestError("input_ids is empty; send at least one prompt token")
        if not 0 <= msg.prior_output_len < n:
            raise InvalidRequestError(
                f"prior_output_len must be in [0, {n}) (it leaves at least one prompt token), got {msg.prior_output_len}"
            )
        if any(not 0 <= t < self.model_config.vocab_size for t in msg.input_ids):
            raise InvalidRequestError(f"input_ids contains ids outside the vocabulary [0, {self.model_config.vocab_size})")
        if n >= self.model_config.context_len:
            raise CapacityError(
                f"prompt has {n} tokens but the model context is {self.model_config.context_len}; shorten the prompt"
            )
        max_new = min(sp.max_new_tokens, self.model_config.context_len - n)  # clamped to the context below
        if n + max_new > self.max_total_num_tokens:
            raise CapacityError(
                f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the KV cache capacity of "
                f"{self.max_total_num_tokens} tokens; lower max_new_tokens or raise --max-total-tokens"
            )

    def hold_for_grammar(self, msg: GenerateReqInput, grammar_queue: GrammarQueue) -> None:
        """A servable request with a grammar joins ``grammar_queue``; the scheduler admits it once compiled."""
        try:
            self.validate(msg)
        except (InvalidRequestError, CapacityError) as e:
            self.out.error(msg.rid, str(e), ErrorCode.INVALID_ARGUMENT)
            return
        refused = (f"request id {msg.rid!r} is already in flight" if msg.rid in self.reqs_by_rid
                   else grammar_queue.add(msg))
        if refused is not None:
            self.out.error(msg.rid, refused, ErrorCode.INVALID_ARGUMENT)

    def build_req(self, msg: GenerateReqInput) -> Req | None:
        """A validated ``Req``, registered under its rid; None after the request was answered with an error."""
        if msg.rid in self.reqs_by_rid:
            self.out.error(msg.rid, f"request id {msg.rid!r} is already in flight", ErrorCode.INVALID_ARGUMENT)
            return None
        inject("input", msg.rid)
        try:
            self.validate(msg)
        except (InvalidRequestError, CapacityError) as e:
            self.out.error(msg.rid, str(e), ErrorCode.INVALID_ARGUMENT)
            return None
        sp = msg.sampling_params
        room = self.model_config.context_len - len(msg.input_ids)
        if sp.max_new_tokens > room:
            sp = msgspec.structs.replace(sp, max_new_tokens=room)
        req = Req(
            msg.rid,
            msg.input_ids,
            sp,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
            bootstrap_room=msg.bootstrap_room,
            prior_output_len=msg.prior_output_len,
            priority=self.resolve_priority(msg.priority),
            stream=msg.stream,
        )
        if sp.grammar_key is not None:
            try:
                req.grammar = self.start_grammar(req)
            except InvalidRequestError as e:
                self.out.error(msg.rid, str(e), ErrorCode.INVALID_ARGUMENT)
                return None
        req.times.queue_enter = time.monotonic()
        self.reqs_by_rid[req.rid] = req
        logger.log(self.request_log_level, "rid=%s room=%s: received, %d prompt tokens, max_new_tokens=%d",
                   req.rid, req.bootstrap_room, len(req.origin_input_ids), sp.max_new_tokens)
        return req

    def start_grammar(self, req: Req) -> Any:
        """The request's matcher, advanced over the outputs of its earlier attempts (a migrated request)."""
        key = req.sampling_params.grammar_key
        assert key is not None
        if self.grammar_matcher is None:
            raise InvalidRequestError(f"{key[0]} needs a grammar backend; this rank has none")
        grammar = self.grammar_matcher(key)
        for i, token in enumerate(req.generated_ids()):
            if not grammar.accept(token):
                raise InvalidRequestError(
                    f"prior output token {i} ({token}) does not follow the request's {key[0]}; the earlier "
                    "attempt's output cannot be continued under this grammar"
                )
        return grammar

    def fail_input(self, rid: str, exc: Exception) -> None:
        """An unexpected error while taking a request in: it fails with INTERNAL; it holds no pages yet."""
        logger.exception("rid=%s: internal error handling the request", rid, exc_info=exc)
        self.reqs_by_rid.pop(rid, None)
        self.out.error(rid, internal_error_message(exc), ErrorCode.INTERNAL)
