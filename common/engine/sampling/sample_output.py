"""One step's sampling results: ``SampleOutput`` (device tensors, as ``Sampler`` returns them), read to the host in
one device-to-host copy as a ``HostSample``; ``HostSampleCopy`` is that copy still in flight (CUDA, pinned memory
behind an event) so the forward thread can launch the next batch meanwhile."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class HostSample:
    """One step's sampling results on the host."""

    next_token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, best first; [] for rows that did not ask


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # int64 [bs]
    logprobs: torch.Tensor | None  # fp32 [bs], raw-logit logprob of the chosen token; None when no row asked
    top_ids: torch.Tensor | None = None  # int64 [bs, k], best first; None when no row asked for top logprobs
    top_vals: torch.Tensor | None = None  # fp32 [bs, k]
    top_nums: list[int] = field(default_factory=list)  # per row, how many of the k it asked for

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        return self.to_host().top_logprobs

    def to_host(self) -> HostSample:
        """Everything the scheduler needs, through ONE device-to-host read (the step's only sync)."""
        return self._unpack(self._flat().tolist())

    def start_to_host(self) -> HostSampleCopy:
        """``to_host`` without waiting (CUDA): the same values copied into pinned host memory behind an event on
        the current stream, so the forward thread can launch the next batch while this one still runs."""
        flat = self._flat()
        pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        pinned.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return HostSampleCopy(self, pinned, event)

    def _flat(self) -> torch.Tensor:
        if self.logprobs is None:
            return self.next_token_ids
        parts = [self.next_token_ids.double(), self.logprobs.double()]
        if self.top_ids is not None and self.top_vals is not None:
            parts += [self.top_ids.double().reshape(-1), self.top_vals.double().reshape(-1)]
        return torch.cat(parts)

    def _unpack(self, flat: list) -> HostSample:
        if self.logprobs is None:
            return HostSample(flat, None, None)
        bs = self.next_token_ids.shape[0]
        ids = [int(x) for x in flat[:bs]]
        top = None
        if self.top_ids is not None:
            k = self.top_ids.shape[1]
            tid, tval = flat[2 * bs : 2 * bs + bs * k], flat[2 * bs + bs * k :]
            top = [
                [(int(tid[i * k + j]), tval[i * k + j]) for j in range(n)] for i, n in enumerate(self.top_nums)
            ]
        return HostSample(ids, flat[bs : 2 * bs], top)


@dataclass
class HostSampleCopy:
    """A ``SampleOutput`` on its way to the host: ``wait`` blocks until the copy (and every kernel of the step before
    it on that stream) is done."""

    sample: SampleOutput
    pinned: torch.Tensor
    event: torch.cuda.Event

    def wait(self) -> HostSample:
        self.event.synchronize()
        return self.sample._unpack(self.pinned.tolist())
