"""Request migration: the request a node gets after an attempt failed having produced tokens.

The continuation's prompt is the client's prompt plus every token so far; ``prior_output_len`` tells the node how many
trailing prompt ids are outputs (seeded draws, penalties and stop strings continue from them); the budgets
(``max_new_tokens``, ``min_new_tokens``) count the remaining tokens only::

    input_ids = client prompt | produced          prior_output_len = len(produced)
    max_new_tokens = client max - len(produced)   min_new_tokens = max(0, client min - len(produced))
"""

from __future__ import annotations

from pdcluster.v1 import common_pb2, worker_pb2
from router.request import GenRequest


def node_request(req: GenRequest, produced: list[int], rid: str) -> worker_pb2.GenerateRequest:
    """The request a node gets: the client's, or after a migration its continuation from ``produced``."""
    sampling = req.sampling_pb
    if produced:
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(req.sampling_pb)
        sampling.max_new_tokens = req.max_new_tokens - len(produced)
        sampling.min_new_tokens = max(0, req.sampling.min_new_tokens - len(produced))
    return worker_pb2.GenerateRequest(
        rid=rid,
        input_ids=req.input_ids + produced,
        sampling_params=sampling,
        return_logprob=req.return_logprob,
        top_logprobs_num=req.top_logprobs_num,
        prior_output_len=len(produced),
        priority=req.priority,
    )


def ended_by(req: GenRequest, ids: list[int]) -> tuple[str, int | None] | None:
    """(finish reason, matched stop id) when ``ids`` already end the request by length or a stop id, else None.
    (An EOS id is the node's to judge: a node that dies right after sending EOS costs one needless migration.)"""
    sp = req.sampling
    if len(ids) >= sp.min_new_tokens and ids[-1] in sp.stop_token_ids:
        return "stop", ids[-1]
    if len(ids) >= sp.max_new_tokens:
        return "length", None
    return None
