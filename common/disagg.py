"""What both disaggregated roles need to reach the KV transfer layer: config, buffers, pages, error codes."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from common.config import ServerArgs
from common.model_runner import ModelRunner
from common.req import Req
from kvtransfer.args import KVArgs, KVTransferConfig
from kvtransfer.manager import KVManager

METADATA_SLOTS_PER_REQUEST_SLOT = 2


def kv_transfer_config(args: ServerArgs, model_fingerprint: Mapping[str, object]) -> KVTransferConfig:
    """Listeners bind ``--host``; every endpoint peers are told names ``--advertise-host`` (default ``--host``)."""
    fingerprint = {k: str(v) for k, v in model_fingerprint.items()}
    fingerprint["serving_dtype"] = args.dtype
    return KVTransferConfig(
        backend=args.kv_transfer_backend,
        host=args.host,
        advertise_host=args.advertised_host,
        bootstrap_timeout_s=args.bootstrap_timeout,
        waiting_timeout_s=args.waiting_timeout,
        transfer_timeout_s=args.transfer_timeout,
        fingerprint=fingerprint,
    )


def make_kv_manager(args: ServerArgs, runner: ModelRunner, mode: str, dp_rank: int) -> KVManager:
    pool = runner.kv_pool
    kv_args = KVArgs.from_pool(
        pool, dp_rank=dp_rank, num_metadata_slots=METADATA_SLOTS_PER_REQUEST_SLOT * args.max_running_requests + 8
    )
    config = kv_transfer_config(args, runner.model_config.fingerprint())
    return KVManager(kv_args, config, mode, bootstrap_addr=bootstrap_addr(args, mode),  # type: ignore[arg-type]
                     dp_size=args.dp_size)


def bootstrap_addr(args: ServerArgs, mode: str) -> str | None:
    """The bootstrap address a prefill rank registers at and hands to decode peers (the advertised host)."""
    return f"{args.advertised_host}:{args.disaggregation_bootstrap_port}" if mode == "prefill" else None


def num_pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def req_pages(req_to_token: torch.Tensor, req: Req, first_page: int, num_tokens: int, page_size: int) -> list[int]:
    """Page numbers holding positions [first_page * page_size, num_tokens) of ``req``.

    Relies on the allocator's alignment invariant (slot % page_size == position % page_size): the first slot of
    each page-aligned position run names its page.
    """
    row = req_to_token[req.req_pool_idx]
    return (row[first_page * page_size : num_tokens : page_size] // page_size).tolist()


def transfer_error_code(reason: str) -> str:
    """gRPC status of a failed transfer: DEADLINE_EXCEEDED for expired states, UNAVAILABLE for lost peers."""
    lowered = reason.lower()
    if "deadline" in lowered or "timed out" in lowered or "timeout" in lowered:
        return "DEADLINE_EXCEEDED"
    if "incompatible" in lowered or "mismatch" in lowered or ("token" in lowered and "cluster" in lowered):
        return "FAILED_PRECONDITION"
    if "aborted" in lowered:
        return "CANCELLED"
    return "UNAVAILABLE"
