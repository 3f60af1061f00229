"""Sampling: request parameters, batched penalties and sampler, stop conditions."""

from common.engine.sampling.params import SamplingParams
from common.engine.sampling.penalties import PenaltyState
from common.engine.sampling.sampler import SampleOutput, Sampler, SamplingBatchInfo, seeded_uniform
from common.engine.sampling.stop import check_finished, stop_prefix_holdback, trim_stop_string

__all__ = [
    "PenaltyState",
    "SampleOutput",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingParams",
    "check_finished",
    "seeded_uniform",
    "stop_prefix_holdback",
    "trim_stop_string",
]
