"""One generation request as the scheduler tracks it.

Token bookkeeping (``fill_ids`` is what the next extend computes up to)::

    origin_input_ids                  output_ids
    |<----------------------------->|<---------------->|
                     |<- prior ->|                          a migrated request: its last ``prior_output_len`` input
                                                            ids are outputs of an interrupted earlier attempt
    |<- prefix_indices ->|<- extend_input_len ->|          (one prefill round; a chunked request has several)
    req_to_token[req_pool_idx, :kv_committed_len] holds the KV slots already written for this request.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from common.engine.sampling.stop import first_stop, stop_window
from common.errors import ErrorCode

if TYPE_CHECKING:
    from common.engine.sampling.params import SamplingParams
    from common.engine.sampling.stop import Detokenizer


_arrivals = itertools.count()  # arrival order without a clock: TP ranks build the same requests in the same order


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class Finished:
    reason: FinishReason
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str = ""  # for ABORT: why
    code: ErrorCode = ErrorCode.CANCELLED  # for ABORT: the gRPC status the client sees
    origin: str = ""  # for ABORT: whose fault, when not this node's (KV_PEER_FAULT: the KV transfer's peer)


@dataclass
class ReqTimes:
    arrival: float = field(default_factory=time.monotonic)
    queue_enter: float = 0.0
    forward_start: float = 0.0  # first prefill chunk started
    bootstrapped: float = 0.0  # disaggregation: the peer's side is ready (prefill: destination pages known)
    transfer_done: float = 0.0  # disaggregation: KV transfer finished
    first_token: float = 0.0
    finished: float = 0.0


class Req:
    """A request inside one scheduler rank. Only the scheduler thread touches it."""

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        bootstrap_room: int | None = None,
        prior_output_len: int = 0,
        priority: int = 0,
        stream: bool = True,
    ) -> None:
        self.rid = rid
        self.origin_input_ids: list[int] = list(input_ids)
        self.output_ids: list[int] = []
        # Outputs produced before a migration, at the end of ``origin_input_ids``. Sampling sees them as outputs
        # (seeded step index, frequency/presence penalties, stop strings); lengths and limits do not.
        self.prior_output_len = prior_output_len
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.eos_token_ids = eos_token_ids
        self.bootstrap_room = bootstrap_room
        self.priority = priority  # with priority scheduling (common.engine.schedule_policy); 0 and unused without
        self.arrival_seq = next(_arrivals)  # strictly increasing: ties in queue orders break by arrival
        self._prompt_key: tuple[int, int] | None = None

        # Memory: the request slot and the prefix matched in the radix cache.
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None  # radix tree node locked on behalf of this request
        self.cached_tokens = 0  # prompt tokens served from the cache (reported to the client)
        self.cached_tokens_host = 0  # of those, loaded back from the host tier (hierarchical cache)
        self.cached_tokens_storage = 0  # of those, prefetched from the storage tier
        self.kv_committed_len = 0  # tokens whose KV is written in req_to_token

        # Prefill progress.
        self.fill_ids: list[int] = []
        self.extend_input_len = 0
        self.is_chunked = 0  # > 0 while a chunked prefill of this request is in progress
        self.is_retracted = False  # retracted and not re-admitted yet: an in-flight token of it is dropped
        # Sits out this round's prefill batch (set by ``SchedulePolicy.prepare`` before every admission round): in-batch
        # prefix caching (another request computes the uncached prefix it shares) or just preempted.
        self.sits_out = False
        self.future_slot: int | None = None  # overlap schedule: the ring slot of its launched, unappended token
        self.to_abort: str | None = None  # set by an abort while the request sits in a batch
        self.stream = stream  # False: its outputs go out once, with its end (``OutputCollector``)
        self.sent_len = 0  # output tokens already streamed out
        self.grammar: Any = None  # RequestGrammar (common/engine/sampling/grammar.py) of a constrained request
        # Speculative decoding (common.engine.spec): the drafter's own state of this request, and its counts.
        self.spec_state: Any = None
        self.spec_verify_ct = 0  # verify forwards that checked drafts of this request
        self.spec_draft_tokens = 0  # draft tokens proposed to it
        self.spec_accepted_tokens = 0  # of them, accepted (emitted)

        # Output.
        self.finished_reason: Finished | None = None
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.decoded_text = ""  # only kept when stop strings are set
        self.times = ReqTimes()

        # Disaggregation: the KV sender/receiver and where the first token came from.
        self.disagg_kv: Any = None  # KVSender (prefill node) or KVReceiver (decode node)
        self.metadata_slot: int | None = None
        self.kv_pages_sent = 0  # prefill node: pages handed to the KVSender so far
        self.kv_transfer_bytes = 0  # decode node: KV bytes received for this request
        self.bootstrap_addr: str | None = None
        self.prefill_dp_rank = 0

    # -- lengths ---------------------------------------------------------------------------------------------------
    @property
    def prompt_key(self) -> tuple[int, int]:
        """(length, hash) of the prompt, computed once: equal prompts have equal keys (repeated-prompt grouping)."""
        if self._prompt_key is None:
            self._prompt_key = (len(self.origin_input_ids), hash(tuple(self.origin_input_ids)))
        return self._prompt_key

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.finished_reason is not None

    def next_input_id(self) -> int:
        """The token a decode step feeds: the last output, or the placeholder of one still being sampled."""
        if self.future_slot is not None:
            return -(self.future_slot + 1)
        return self.output_ids[-1]

    def draw_step(self) -> int:
        """Index of the output token the next launched step draws (counts a launched, unappended token and the
        outputs of earlier attempts)."""
        return self.prior_output_len + len(self.output_ids) + (self.future_slot is not None)

    def generated_ids(self) -> list[int]:
        """Every output token of the request, those of earlier attempts (a migration) first."""
        if not self.prior_output_len:
            return self.output_ids
        return self.origin_input_ids[len(self.origin_input_ids) - self.prior_output_len :] + self.output_ids

    def finishes_with_pending(self) -> bool:
        """Its launched, unappended token will end it by length: it needs no further step."""
        return self.future_slot is not None and len(self.output_ids) + 1 >= self.sampling_params.max_new_tokens

    def init_next_round_input(self, tree_cache: Any | None) -> None:
        """Recompute ``fill_ids`` and the cached prefix before (re)entering a prefill batch."""
        self.fill_ids = self.all_ids()
        if tree_cache is not None:
            match = tree_cache.match_prefix(self.fill_ids[: len(self.fill_ids) - 1])
            self.prefix_indices, self.last_node = match.device_indices, match.last_node
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def reset_for_retract(self) -> None:
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.extend_input_len = 0
        self.kv_committed_len = 0
        self.is_chunked = 0
        self.is_retracted = True
        self.future_slot = None

    # -- output ----------------------------------------------------------------------------------------------------
    def take_token(self, token: int, tokenizer: Detokenizer | None, logprob: float | None = None,
                   top_logprobs: list[tuple[int, float]] | None = None) -> bool:
        """The one way a sampled token joins the request (a decode or prefill step's, each of a verify's accepted
        run, the prefill node's first token on a decode node): the grammar accepts it, it is appended with its
        logprobs, then the stop checks run. A token the grammar refuses (drawn only when no token may continue it)
        is dropped and the request ends as a dead end: False."""
        grammar = self.grammar
        if grammar is not None and not grammar.accept(token):
            self.abort(grammar.dead_end_message(len(self.generated_ids())), ErrorCode.INVALID_ARGUMENT)
            return False
        self.output_ids.append(token)
        if not self.times.first_token:
            self.times.first_token = time.monotonic()
        if self.return_logprob and logprob is not None:
            self.output_logprobs.append(logprob)
            if top_logprobs is not None:
                self.output_top_logprobs.append(top_logprobs)
        self.check_finished(token, tokenizer)
        if grammar is not None and self.finished_reason is None and grammar.is_terminated():
            self.finished_reason = Finished(FinishReason.STOP, matched=token)  # even where its stop token is not
        return True

    def check_finished(self, token: int, tokenizer: Detokenizer | None) -> None:
        """Set ``finished_reason`` if ``token`` (already the last output) ends the request; the order of the checks:
        ``common.engine.sampling.stop``."""
        if self.finished_reason is not None:
            return
        params = self.sampling_params
        n_out = len(self.output_ids)
        if n_out >= params.min_new_tokens:
            if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
                self.finished_reason = Finished(FinishReason.STOP, matched=token)
                return
            if params.stop:
                matched = self._match_stop_string(tokenizer)
                if matched is not None:
                    self.finished_reason = Finished(FinishReason.STOP, matched=matched)
                    return
        if n_out >= params.max_new_tokens:
            self.finished_reason = Finished(FinishReason.LENGTH)

    def _match_stop_string(self, tokenizer: Detokenizer | None) -> str | None:
        params = self.sampling_params
        if tokenizer is None:
            raise ValueError(f"request {self.rid} has stop strings but the scheduler was given no tokenizer")
        window = stop_window(params.stop)
        ids = self.output_ids if len(self.output_ids) >= window else self.generated_ids()  # spans a migration
        tail = tokenizer.decode(ids[-window:], skip_special_tokens=params.skip_special_tokens)
        return first_stop(tail, params.stop)[1]

    def abort(self, message: str, code: ErrorCode = ErrorCode.CANCELLED, origin: str = "") -> None:
        self.finished_reason = Finished(FinishReason.ABORT, message=message, code=code, origin=origin)

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input_len={len(self.origin_input_ids)}, output_len={len(self.output_ids)})"
