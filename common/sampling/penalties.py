"""Batched logit penalties, kept incrementally across decode steps.

Row ``i`` of every tensor belongs to request ``i`` of the owning batch. Each penalty is one component that exists
only while some row uses it; a row whose penalty is neutral may hold any state (its penalty multiplies it out).
Per step: ``apply`` is a few elementwise ops over ``[bs, vocab]``, ``cumulate_output_tokens`` one scatter per
component (no per-row Python loop).

- repetition (HF ``RepetitionPenaltyLogitsProcessor``): over prompt + output tokens, ``logit > 0 -> logit / p``,
  else ``logit * p``.
- frequency / presence (OpenAI): over output tokens, ``logit -= f * count + p * (count > 0)``.
- min_new_tokens: EOS (unless ``ignore_eos``) and ``stop_token_ids`` get ``-inf`` until the request has produced
  ``min_new_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, Self

import torch

if TYPE_CHECKING:
    from common.req import Req


def _row_mask(
    rows: list[list[int]], vocab_size: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """``[len(rows), vocab]`` tensor with ``out[i, t]`` = how often ``t`` occurs in ``rows[i]`` (0/1 for bool)."""
    out = torch.zeros(len(rows), vocab_size, dtype=dtype, device=device)
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    if int(lens.sum()) == 0:
        return out
    row_idx = torch.repeat_interleave(torch.arange(len(rows)), lens).to(device)
    col_idx = torch.tensor([t for r in rows for t in r], dtype=torch.int64, device=device)
    out.index_put_((row_idx, col_idx), torch.ones(len(col_idx), dtype=dtype, device=device), accumulate=True)
    return out


class _Component(Protocol):
    values: list[float]  # per-row Python mirror of the parameter, to decide activity without a device sync

    def is_active(self) -> bool: ...
    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...
    def cumulate(self, next_ids: torch.Tensor) -> None: ...
    def filter(self, keep: torch.Tensor, keep_list: list[int]) -> Self: ...
    def merge(self, other: Self) -> Self: ...


class RepetitionPenalty:
    def __init__(self, values: list[float], seen: torch.Tensor) -> None:
        self.values = values
        self.penalty = torch.tensor(values, dtype=torch.float32, device=seen.device).unsqueeze(1)  # [bs, 1]
        self.seen = seen  # [bs, vocab] bool: token occurs in prompt or output

    @classmethod
    def build(cls, reqs: Sequence[Req], vocab_size: int, device: torch.device) -> Self:
        values = [float(r.sampling_params.repetition_penalty) for r in reqs]
        rows = [
            r.origin_input_ids + r.output_ids if v != 1.0 else [] for r, v in zip(reqs, values, strict=True)
        ]
        return cls(values, _row_mask(rows, vocab_size, device, torch.bool))

    @classmethod
    def neutral(cls, bs: int, vocab_size: int, device: torch.device) -> Self:
        return cls([1.0] * bs, torch.zeros(bs, vocab_size, dtype=torch.bool, device=device))

    def is_active(self) -> bool:
        return any(v != 1.0 for v in self.values)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as HF (x / p or x * p in fp32), so greedy tokens match HF bit for bit.
        penalised = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return torch.where(self.seen, penalised, logits)

    def cumulate(self, next_ids: torch.Tensor) -> None:
        self.seen.scatter_(1, next_ids.unsqueeze(1), True)

    def filter(self, keep: torch.Tensor, keep_list: list[int]) -> Self:
        return type(self)([self.values[i] for i in keep_list], self.seen[keep])

    def merge(self, other: Self) -> Self:
        return type(self)(self.values + other.values, torch.cat([self.seen, other.seen]))


class FrequencyPresencePenalty:
    def __init__(self, freq: list[float], pres: list[float], counts: torch.Tensor) -> None:
        self.freq_values, self.pres_values = freq, pres
        self.values = [abs(f) + abs(p) for f, p in zip(freq, pres, strict=True)]
        self.freq = torch.tensor(freq, dtype=torch.float32, device=counts.device).unsqueeze(1)  # [bs, 1]
        self.pres = torch.tensor(pres, dtype=torch.float32, device=counts.device).unsqueeze(1)  # [bs, 1]
        self.counts = counts  # [bs, vocab] int32: occurrences among output tokens only

    @classmethod
    def build(cls, reqs: Sequence[Req], vocab_size: int, device: torch.device) -> Self:
        freq = [float(r.sampling_params.frequency_penalty) for r in reqs]
        pres = [float(r.sampling_params.presence_penalty) for r in reqs]
        rows = [r.output_ids if f or p else [] for r, f, p in zip(reqs, freq, pres, strict=True)]
        return cls(freq, pres, _row_mask(rows, vocab_size, device, torch.int32))

    @classmethod
    def neutral(cls, bs: int, vocab_size: int, device: torch.device) -> Self:
        return cls([0.0] * bs, [0.0] * bs, torch.zeros(bs, vocab_size, dtype=torch.int32, device=device))

    def is_active(self) -> bool:
        return any(self.values)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits - self.freq * self.counts - self.pres * (self.counts > 0)

    def cumulate(self, next_ids: torch.Tensor) -> None:
        ones = torch.ones(next_ids.shape[0], 1, dtype=torch.int32, device=next_ids.device)
        self.counts.scatter_add_(1, next_ids.unsqueeze(1), ones)

    def filter(self, keep: torch.Tensor, keep_list: list[int]) -> Self:
        freq = [self.freq_values[i] for i in keep_list]
        return type(self)(freq, [self.pres_values[i] for i in keep_list], self.counts[keep])

    def merge(self, other: Self) -> Self:
        counts = torch.cat([self.counts, other.counts])
        return type(self)(self.freq_values + other.freq_values, self.pres_values + other.pres_values, counts)


class MinNewTokensPenalty:
    def __init__(self, values: list[float], output_lens: torch.Tensor, stop_mask: torch.Tensor) -> None:
        self.values = values  # min_new_tokens per row
        self.min_new = torch.tensor(values, dtype=torch.int64, device=stop_mask.device)  # [bs]
        self.output_lens = output_lens  # [bs] int64, tokens produced so far
        self.stop_mask = stop_mask  # [bs, vocab] bool: the row's EOS (unless ignore_eos) and stop_token_ids

    @classmethod
    def build(cls, reqs: Sequence[Req], vocab_size: int, device: torch.device) -> Self:
        values: list[float] = [r.sampling_params.min_new_tokens for r in reqs]
        rows = []
        for r, v in zip(reqs, values, strict=True):
            stops = set(r.sampling_params.stop_token_ids)
            if not r.sampling_params.ignore_eos:
                stops |= r.eos_token_ids
            # NOTE: ids beyond the logits' width cannot be sampled anyway; dropping them keeps scatter in range.
            rows.append(sorted(t for t in stops if 0 <= t < vocab_size) if v > len(r.output_ids) else [])
        lens = torch.tensor([len(r.output_ids) for r in reqs], dtype=torch.int64, device=device)
        return cls(values, lens, _row_mask(rows, vocab_size, device, torch.bool))

    @classmethod
    def neutral(cls, bs: int, vocab_size: int, device: torch.device) -> Self:
        lens = torch.zeros(bs, dtype=torch.int64, device=device)
        return cls([0] * bs, lens, torch.zeros(bs, vocab_size, dtype=torch.bool, device=device))

    def is_active(self) -> bool:
        return any(self.values)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        blocked = self.stop_mask & (self.output_lens < self.min_new).unsqueeze(1)
        return logits.masked_fill(blocked, float("-inf"))

    def cumulate(self, next_ids: torch.Tensor) -> None:
        self.output_lens += 1

    def filter(self, keep: torch.Tensor, keep_list: list[int]) -> Self:
        return type(self)([self.values[i] for i in keep_list], self.output_lens[keep], self.stop_mask[keep])

    def merge(self, other: Self) -> Self:
        lens = torch.cat([self.output_lens, other.output_lens])
        return type(self)(self.values + other.values, lens, torch.cat([self.stop_mask, other.stop_mask]))


_COMPONENTS: tuple[type[RepetitionPenalty | FrequencyPresencePenalty | MinNewTokensPenalty], ...] = (
    RepetitionPenalty,
    FrequencyPresencePenalty,
    MinNewTokensPenalty,
)


class PenaltyState:
    """All penalties of one batch. ``components`` holds only the active ones, in application order."""

    def __init__(
        self, batch_size: int, vocab_size: int, device: torch.device, components: dict[type, _Component]
    ) -> None:
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.device = device
        self.components: dict[type, _Component] = {k: v for k, v in components.items() if v.is_active()}

    @classmethod
    def from_reqs(cls, reqs: Sequence[Req], vocab_size: int, device: torch.device | str) -> PenaltyState:
        """Build from each request's prompt and output ids (the state after ``len(output_ids)`` cumulations)."""
        device = torch.device(device)
        # NOTE: a component no request uses is not built at all: building allocates [bs, vocab] on the device.
        params = [r.sampling_params for r in reqs]
        wanted = {
            RepetitionPenalty: any(p.repetition_penalty != 1.0 for p in params),
            FrequencyPresencePenalty: any(p.frequency_penalty or p.presence_penalty for p in params),
            MinNewTokensPenalty: any(p.min_new_tokens for p in params),
        }
        comps = {c: c.build(reqs, vocab_size, device) for c in _COMPONENTS if wanted[c]}
        return cls(len(reqs), vocab_size, device, comps)

    @property
    def is_active(self) -> bool:
        return bool(self.components)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return penalised logits ``[bs, vocab]`` (a new tensor; the input is not modified)."""
        for comp in self.components.values():
            logits = comp.apply(logits)
        return logits

    def cumulate_output_tokens(self, next_ids: torch.Tensor) -> None:
        """Record one new output token per row (``next_ids``: int64 ``[bs]`` on this state's device)."""
        for comp in self.components.values():
            comp.cumulate(next_ids)

    def filter(self, keep_indices: list[int]) -> None:
        """Keep rows ``keep_indices`` (in that order); components no kept row uses are dropped."""
        keep = torch.tensor(keep_indices, dtype=torch.int64, device=self.device)
        comps = {k: c.filter(keep, keep_indices) for k, c in self.components.items()}
        self.components = {k: c for k, c in comps.items() if c.is_active()}
        self.batch_size = len(keep_indices)

    def merge(self, other: PenaltyState) -> None:
        """Append ``other``'s rows after this batch's rows; a component missing on one side starts neutral there."""
        merged: dict[type, _Component] = {}
        for kind in _COMPONENTS:
            mine, theirs = self.components.get(kind), other.components.get(kind)
            if mine is None and theirs is None:
                continue
            mine = mine or kind.neutral(self.batch_size, self.vocab_size, self.device)
            theirs = theirs or kind.neutral(other.batch_size, self.vocab_size, self.device)
            merged[kind] = mine.merge(theirs)  # type: ignore[arg-type]
        self.components = merged
        self.batch_size += other.batch_size
