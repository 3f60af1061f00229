"""The glue both serving roles share to reach the KV transfer layer: a rank's transfer endpoint (manager, TP group
polls, wire bytes per page) over a model runner's pool, and the transfer config from the server args.

The pool of a TP rank holds only that rank's KV heads, so the model's total comes from the model config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.manager import KVManager, Rooms
from kvtransfer.poll import GroupPolls
from kvtransfer.prefill_rooms import PrefillRooms

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.distributed import TPGroup
    from common.engine.model_runner import ModelRunner

METADATA_SLOTS_PER_REQUEST_SLOT = 2
ROOMS: dict[Mode, type[Rooms]] = {"prefill": PrefillRooms, "decode": DecodeRooms}


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
        backend_options=args.kv_transfer_options,
    )


def make_kv_manager(args: ServerArgs, runner: ModelRunner, mode: Mode, dp_rank: int, *, tp_rank: int = 0,
                    tp_size: int = 1) -> KVManager:
    """The KV manager of scheduler rank (``dp_rank``, ``tp_rank``) over ``runner``'s pool, with ``mode``'s rooms."""
    draft = runner.draft_kv  # EAGLE's head, a STANDALONE draft: its KV layers after the target's, its state in metadata
    kv_args = KVArgs.from_pool(
        runner.kv_pool, tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank,
        total_kv_heads=runner.model_config.num_kv_heads,
        num_metadata_slots=METADATA_SLOTS_PER_REQUEST_SLOT * args.max_running_requests + 8,
        extra_layers=draft.layers if draft else (), draft_state_dims=draft.state_dims if draft else (0, 0),
        extra_total_kv_heads=draft.total_kv_heads if draft else 0,
    )
    config = kv_transfer_config(args, {**runner.model_config.fingerprint(), **(draft.fingerprint if draft else {})})
    return KVManager(kv_args, config, ROOMS[mode], bootstrap_addr=bootstrap_addr(args, mode), dp_size=args.dp_size)


@dataclass
class RankTransfer:
    """What a prefill or decode rank holds of the KV transfer layer."""

    manager: KVManager
    polls: GroupPolls  # the MIN of KVPoll over the rank's TP group
    bytes_per_page: int  # bytes one page moves: the model's KV and a draft's (all KV heads, every layer)

    def close(self) -> None:
        self.manager.close()


def rank_transfer(args: ServerArgs, runner: ModelRunner, mode: Mode, dp_rank: int, tp: TPGroup) -> RankTransfer:
    manager = make_kv_manager(args, runner, mode, dp_rank, tp_rank=tp.tp_rank, tp_size=tp.tp_size)
    return RankTransfer(manager, GroupPolls(tp.all_reduce_min, tp.tp_rank, tp.tp_size),
                        manager.args.model_bytes_per_page)


def bootstrap_addr(args: ServerArgs, mode: Mode) -> str | None:
    """The bootstrap address a prefill rank registers at: its node's advertised host, or with ``--nnodes`` > 1 the
    host of node 0 (``--dist-init-addr``), which alone serves the Bootstrap service for the whole group."""
    if mode != "prefill":
        return None
    host = args.advertised_host
    if args.nnodes > 1 and args.dist_init_addr:
        host = args.dist_init_addr.rpartition(":")[0]
    return f"{host}:{args.disaggregation_bootstrap_port}"

