"""Batched logit penalties, kept incrementally across decode steps.

Row ``i`` of every tensor belongs to request ``i`` of the owning batch. Each penalty is one component that exists
only while some row uses it; a row whose penalty is neutral may hold any state (its penalty multiplies it out).
Per step: ``apply`` is a few elementwise ops over ``[bs, vocab]``, ``cumulate_output_tokens`` one scatter per
component (no per-row Python loop). ``PenaltyState.from_reqs`` builds every component's inputs on the host and ships
them in one host-to-device copy (``host_inputs`` -> ``common.engine.device.ship`` -> ``from_device``); the ``[bs, vocab]``
tensors are then filled on the device from sparse (row, token) indices.

- repetition (HF ``RepetitionPenaltyLogitsProcessor``): over prompt + output tokens, ``logit > 0 -> logit / p``,
  else ``logit * p``.
- frequency / presence (OpenAI): over output tokens (a migrated request's earlier outputs included),
  ``logit -= f * count + p * (count > 0)``.
- min_new_tokens: EOS (unless ``ignore_eos``) and ``stop_token_ids`` get ``-inf`` until the request has produced
  ``min_new_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, Self

import torch

from common.engine.device import ship

if TYPE_CHECKING:
    from common.engine.req import Req


Columns = list[list[float]]  # host inputs of one component, shipped as float64 (exact for ids and float32 values)


def _mask_columns(rows: list[list[int]]) -> Columns:
    """Sparse form of a ``[len(rows), vocab]`` occurrence mask: the row and the token of every occurrence."""
    return [[float(i) for i, r in enumerate(rows) for _ in r], [float(t) for r in rows for t in r]]


def _mask_on_device(
    row_idx: torch.Tensor, col_idx: torch.Tensor, bs: int, vocab_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[bs, vocab]`` tensor with ``out[i, t]`` = how often ``(i, t)`` occurs (0/1 for bool), on the indices' device."""
    out = torch.zeros(bs, vocab_size, dtype=dtype, device=row_idx.device)
    if row_idx.numel():
        ones = torch.ones(row_idx.numel(), dtype=dtype, device=row_idx.device)
        out.index_put_((row_idx.to(torch.int64), col_idx.to(torch.int64)), ones, accumulate=True)
    return out


def _build(cls: Any, reqs: Sequence[Req], vocab_size: int, device: torch.device) -> Any:
    """``cls.host_inputs`` -> one copy -> ``cls.from_device``: one component built alone."""
    values, cols = cls.host_inputs(reqs, vocab_size)
    dev = ship([torch.tensor(c, dtype=torch.float64) for c in cols], device)
    return cls.from_device(values, dev, len(reqs), vocab_size)


class _Component(Protocol):
    values: list[float]  # per-row Python mirror of the parameter, to decide activity without a device sync

    def is_active(self) -> bool: ...
    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...
    def cumulate(self, next_ids: torch.Tensor) -> None: ...
    def filter(self, keep: torch.Tensor, keep_list: list[int]) -> Self: ...
    def merge(self, other: Self) -> Self: ...


class RepetitionPenalty:
    def __init__(self, values: list[float], seen: torch.Tensor, penalty: torch.Tensor | None = None) -> None:
        self.values = values
        if penalty is None:
            penalty = torch.tensor(values, dtype=torch.float32, device=seen.device)
        self.penalty = penalty.unsqueeze(1)  # [bs, 1]
        self.seen = seen  # [bs, vocab] bool: token occurs in prompt or output

    @classmethod
    def host_inputs(cls, reqs: Sequence[Req], vocab_size: int) -> tuple[list[float], Columns]:
        values = [float(r.sampling_params.repetition_penalty) for r in reqs]
        rows = [
            r.origin_input_ids + r.output_ids if v != 1.0 else [] for r, v in zip(reqs, values, strict=True)
        ]
        return values, [values, *_mask_columns(rows)]

    @classmethod
    def from_device(cls, values: list[float], cols: list[torch.Tensor], bs: int, vocab_size: int) -> Self:
        penalty, row_idx, col_idx = cols
        return cls(values, _mask_on_device(row_idx, col_idx, bs, vocab_size, torch.bool), penalty.float())

    @classmethod
    def build(cls, reqs: Sequence[Req], vocab_size: int, device: torch.device) -> Self:
        return _build(cls, reqs, vocab_size, device)

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
    def __init__(
        self, freq: list[float], pres: list[float], counts: torch.Tensor,
        freq_pres: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.freq_values, self.pres_values = freq, pres
        self.values = [abs(f) + abs(p) for f, p in zip(freq, pres, strict=True)]
        if freq_pres is None:
            freq_pres = (torch.tensor(freq, dtype=torch.float32, device=counts.device),
                         torch.tensor(pres, dtype=torch.float32, device=counts.device))
        self.freq = freq_pres[0].unsqueeze(1)  # [bs, 1]
        self.pres = freq_pres[1].unsqueeze(1)  # [bs, 1]
        self.counts = counts  # [bs, vocab] int32: occurrences among output tokens only

    @classmethod
    def host_inputs(cls, reqs: Sequence[Req], vocab_size: int) -> tuple[list[float], Columns]:
        freq = [float(r.sampling_params.frequency_penalty) for r in reqs]
        pres = [float(r.sampling_params.presence_penalty) for r in reqs]
        rows = [r.generated_ids() if f or p else [] for r, f, p in zip(reqs, freq, pres, strict=True)]
        return freq + pres, [freq, pres, *_mask_columns(rows)]

    @classmethod
    def from_device(cls, values: list[float], cols: list[torch.Tensor], bs: int, vocab_size: int) -> Self:
        freq, pres, row_idx, col_idx = cols
        counts = _mask_on_device(row_idx, col_idx, bs, vocab_size, torch.int32)
        return cls(values[:bs], values[bs:], counts, (freq.float(), pres.float()))

    @classmethod
    def build(cls, reqs: Sequence[Req], vocab_size: int, device: torch.device) -> Self:
        return _build(cls, reqs, vocab_size, device)

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
    def __init__(
        self, values: list[float], output_lens: torch.Tensor, stop_mask: torch.Tensor,
        min_new: torch.Tensor | None = None,
    ) -> None:
        self.values = values  # min_new_tokens per row
        if min_new is None:
            min_new = torch.tensor(values, dtype=torch.int64, device=stop_mask.device)
        self.min_new = min_new  # [bs] int64
        self.output_lens = output_lens  # [bs] int64, tokens produced so far
        self.stop_mask = stop_mask  # [bs, vocab] bool: the row's EOS (unless ignore_eos) and stop_token_ids

    @classmethod
    def host_inputs(cls, reqs: Sequence[Req], vocab_size: int) -> tuple[list[float], Columns]:
        values: list[float] = [r.sampling_params.min_new_tokens for r in reqs]
        rows = []
        for r, v in zip(reqs, values, strict=True):
            stops = set(r.sampling_params.stop_token_ids)
            if not r.sampling_params.ignore_eos:
                stops |= r.eos_token_ids
            # NOTE: ids beyond the logits' width cannot be sampled anyway; dropping them keeps scatter in range.
            rows.append(sorted(t for t in stops if 0 <= t < vocab_size) if v > len(r.output_ids) else [])
        lens = [float(len(r.output_ids)) for r in reqs]
        return values, [[float(v) for v in values], lens, *_mask_columns(rows)]

    @classmethod
    def from_device(cls, values: list[float], cols: list[torch.Tensor], bs: int, vocab_size: int) -> Self:
        min_new, lens, row_idx, col_idx = cols
        stop_mask = _mask_on_device(row_idx, col_idx, bs, vocab_size, torch.bool)
        return cls(values, lens.to(torch.int64), stop_mask, min_new.to(torch.int64))

    @classmethod
    def build(cls, reqs: Sequence[Req], vocab_size: int, device: torch.device) -> Self:
        return _build(cls, reqs, vocab_size, device)

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
        inputs = {c: c.host_inputs(reqs, vocab_size) for c in _COMPONENTS if wanted[c]}
        host = [torch.tensor(col, dtype=torch.float64) for _, cols in inputs.values() for col in cols]
        dev = iter(ship(host, device))  # one copy for every component
        comps: dict[type, _Component] = {
            c: c.from_device(values, [next(dev) for _ in cols], len(reqs), vocab_size)
            for c, (values, cols) in inputs.items()
        }
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
