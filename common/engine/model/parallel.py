"""How a Llama-family model is split over the ranks of one tensor-parallel group (the rule the loader, the model,
the KV pool and KV transfer share).

With ``tp`` ranks, rank r holds:

    attention heads  [r*H/tp, (r+1)*H/tp)                         (H % tp == 0)
    KV heads         [r*K/tp, (r+1)*K/tp) when K >= tp            (K % tp == 0)
                     the single replicated head r // (tp/K) else  (tp % K == 0)
    MLP rows         [r*I/tp, (r+1)*I/tp) of gate and of up       (I % tp == 0)
    vocab rows       [r*Vp/tp, (r+1)*Vp/tp), Vp = V rounded up to a multiple of tp; rows >= V are zero

Invariant: rank r's query heads all attend with KV heads it holds (query head h uses KV head h // (H/K)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import ConfigError

if TYPE_CHECKING:
    from common.engine.model.config import ModelConfig


def owned_kv_heads(tp_rank: int, tp_size: int, total_heads: int) -> range:
    """Global KV heads held by one TP rank (one replicated head when ``total_heads < tp_size``)."""
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp_size // total_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of the model. ``tp_size == 1`` is the whole model."""

    tp_rank: int
    tp_size: int
    num_heads: int  # local attention heads
    kv_heads: range  # global ids of the local KV heads
    intermediate: int  # local gate (and up) rows
    vocab_size: int  # the model's vocab (logits are sliced back to it)
    vocab_per_rank: int  # local LM head rows, padding included

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def q_heads(self) -> range:
        return range(self.tp_rank * self.num_heads, (self.tp_rank + 1) * self.num_heads)

    @property
    def vocab_rows(self) -> range:
        """Local LM head rows that hold real vocab entries (global ids); the rest of the shard is zero."""
        start = self.tp_rank * self.vocab_per_rank
        return range(min(start, self.vocab_size), min(start + self.vocab_per_rank, self.vocab_size))

    @classmethod
    def for_config(cls, cfg: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> ShardLayout:
        """Raise ``ConfigError`` naming the sizes when ``tp_size`` cannot split ``cfg``."""
        check_tp_size(cfg, tp_size)
        return cls(
            tp_rank=tp_rank,
            tp_size=tp_size,
            num_heads=cfg.num_heads // tp_size,
            kv_heads=owned_kv_heads(tp_rank, tp_size, cfg.num_kv_heads),
            intermediate=cfg.intermediate_size // tp_size,
            vocab_size=cfg.vocab_size,
            vocab_per_rank=-(-cfg.vocab_size // tp_size),
        )


def check_tp_size(cfg: ModelConfig, tp_size: int) -> None:
    name = f"{cfg.architecture} at {cfg.path}"
    if tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, got {tp_size}")
    if cfg.num_heads % tp_size:
        raise ConfigError(
            f"--tp-size {tp_size} does not divide the {cfg.num_heads} attention heads of {name}; "
            "choose a divisor of num_attention_heads"
        )
    kv = cfg.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise ConfigError(
            f"--tp-size {tp_size} and the {kv} KV heads of {name}: one must divide the other "
            "(KV heads are split, or replicated when fewer than the ranks)"
        )
    if cfg.intermediate_size % tp_size:
        raise ConfigError(
            f"--tp-size {tp_size} does not divide intermediate_size {cfg.intermediate_size} of {name}"
        )
