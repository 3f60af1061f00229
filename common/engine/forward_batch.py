"""What the model runner sees for one forward pass.

Data flows ``Req`` -> ``ScheduleBatch`` (scheduler view) -> ``ModelWorkerBatch`` (plain lists for the runner)
-> ``ForwardBatch`` (tensors).  Token layout of one forward (``num_tokens = sum(extend_lens)``)::

    input_ids / positions / out_cache_loc:  | req0: extend_lens[0] tokens | req1: ... | ... |
    req0 covers sequence positions [prefix_lens[0], seq_lens[0]); decode requests have extend_len 1.

``req_to_token[req_pool_indices[i], :seq_lens[i]]`` holds the KV slots of request i after this forward; the slots of
the new tokens (``out_cache_loc``) are already written there by the scheduler before the forward.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from common.engine.mem.kv_pool import MHATokenToKVPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill of new tokens (possibly after a cached prefix or an earlier chunk)
    DECODE = 2  # one new token per request
    MIXED = 3  # a prefill chunk plus running decode requests (extend_len 1 each) in one pass
    IDLE = 4  # nothing to run (DP ranks keep step with their peers)
    # Speculative decoding (common.engine.spec): the target verifies each request's drafts as an extend of its last
    # token and its drafts, with logits at every position; the draft model (or EAGLE's head) extends over tokens it has
    # not seen after a verify / decode step (its extends over a prefill forward's tokens are EXTEND, as SGLang's).
    TARGET_VERIFY = 5
    DRAFT_EXTEND = 6

    def is_extend(self) -> bool:
        """A prefill (chunk) from the scheduler's view: its requests join the running batch afterwards."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def logits_at_every_token(self) -> bool:
        """Every new token's logits are sampled (a decode's one token, a verify's drafts), not only each request's
        last."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    out_cache_loc: torch.Tensor  # int64 [num_tokens], KV slot written for each new token
    req_pool_indices: torch.Tensor  # int64 [bs]
    seq_lens: torch.Tensor  # int64 [bs], length after this forward (prefix + extend)
    extend_lens: torch.Tensor  # int64 [bs]
    prefix_lens: torch.Tensor  # int64 [bs]
    req_to_token: torch.Tensor  # int64 [pool_size, max_context_len], the ReqToTokenPool table
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    kv_pool: MHATokenToKVPool
    attn_backend: Any  # common.engine.model.attention.TorchAttentionBackend; metadata set by init_forward_metadata
    attn_metadata: Any = None
    future_slots: torch.Tensor | None = None  # int64 [bs] overlap: the ring slot each row's token is stored in
    # bool [sum(extend_lens[i] ** 2)]: request i's [extend_len, extend_len] block (row-major, requests in order) says
    # which of its new tokens each new token sees (a draft tree's ancestor mask; within the causal order); the cached
    # prefix stays visible. ``positions`` then need not be consecutive. None: causal.
    custom_mask: torch.Tensor | None = None
    spec_info: Any = None  # speculative decoding: the batch's VerifyInput (common.engine.spec.info)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def last_token_indices(self) -> torch.Tensor:
        """Index into the token dimension of each request's last new token (where its next-token logits come from)."""
        return torch.cumsum(self.extend_lens, 0) - 1
