"""Requests and draws for the sampler's tests (tests/engine/test_sampling*.py, test_stop_conditions.py)."""

from __future__ import annotations

import torch

from common.engine.req import Req
from common.engine.sampling.params import SamplingParams
from common.engine.sampling.sampler import Sampler, SamplingBatchInfo

V = 64
EOS = 0


def make_req(rid: str = "r", prompt: list[int] | None = None, **params: object) -> Req:
    return Req(rid, prompt or [5, 6, 7], SamplingParams(**params), eos_token_ids=frozenset({EOS}))  # type: ignore[arg-type]


def sample(reqs: list[Req], logits: torch.Tensor, sampler: Sampler | None = None) -> torch.Tensor:
    info = SamplingBatchInfo.from_reqs(reqs, logits.shape[1], "cpu")
    return (sampler or Sampler(seed=0))(logits, info).next_token_ids


def empirical(
    params: dict,
    logits_row: torch.Tensor,
    n: int = 20000,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
) -> torch.Tensor:
    """Token frequencies over ``n`` unseeded draws of one request from a fixed logits row."""
    r = make_req("e", prompt, **params)
    r.output_ids = list(output or [])
    reqs = [r] * n  # n rows of the same request: a batch of n independent draws
    ids = sample(reqs, logits_row.expand(n, -1).clone(), Sampler(seed=1))
    return torch.bincount(ids, minlength=logits_row.shape[0]).float() / n
