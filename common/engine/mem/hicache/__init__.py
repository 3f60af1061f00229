"""The hierarchical KV cache (``--enable-hierarchical-cache``; SGLang's HiCache): a host tier under the radix cache
and a storage tier under that, shared by the nodes of one model.

    host_pool      HostKVPool: host copies of KV pages, a drafter's KV layers included (bounded, LRU through the tree;
                   pinned on CUDA)
    copy_engine    CopyEngine: device <-> host page batches on threads (and CUDA streams) of its own
    load_waits     LoadWaits: a queued request's deadline for its load; loads given up on (--hicache-load-timeout);
                   the TP group's verdicts on loads, write-throughs and the writes a step waits for
    tree           HiTreeNode: which tier each node's pages are on
    host_tree      HostTierTree: the tree's host-side walks (host LRU eviction, storage pages joining the tree)
    backup_tree    BackupTree: device -> host copies of nodes and device eviction (an eviction's own write)
    hiradix_cache  HiRadixCache: the prefill / colocated node's tree (write policies, load back)
    storage_tier   StorageTier: prefetch and write-behind over a storage backend (``storage/``)
    decode_offload HiHeldPrefixCache: a decode node keeps retracted requests' KV on the host and restores it

``build_prefix_cache`` is the one place a rank picks its prefix cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil
import torch

from common.engine.mem.chunk_cache import ChunkCache
from common.engine.mem.held_prefix_cache import HeldPrefixCache
from common.engine.mem.hicache.copy_engine import CopyEngine, Fence
from common.engine.mem.hicache.host_pool import HostKVPool, device_page_bytes, slot_space_groups
from common.engine.mem.radix_cache import BasePrefixCache, RadixCache
from common.errors import ConfigError

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.distributed import TPGroup
    from common.engine.model.config import ModelConfig
    from common.engine.model_runner import ModelRunner
    from common.engine.spec.drafter import DraftKV

logger = logging.getLogger(__name__)
GB = 10**9  # --hicache-size is in SGLang's GB


def build_prefix_cache(args: ServerArgs, runner: ModelRunner, tp: TPGroup, fence: Callable[[], Fence],
                       model_config: ModelConfig) -> BasePrefixCache:
    """The rank's prefix cache: radix (hierarchical with --enable-hierarchical-cache) on prefill and colocated nodes,
    the held-prompt tree on decode nodes (with a host tier for retracted requests), or none."""
    slots, alloc, page = runner.req_to_token_pool, runner.allocator, args.page_size
    if not args.enable_hierarchical_cache:
        if args.use_radix_cache:
            return RadixCache(slots, alloc, page)
        if args.shares_decode_prompts:
            return HeldPrefixCache(slots, alloc, page)
        return ChunkCache(slots, alloc, page)
    groups = device_groups(runner)
    host_pool = HostKVPool(groups, page, host_pool_pages(args, runner, device_page_bytes(groups, page)),
                           args.hicache_mem_layout, pin=runner.device.type == "cuda")
    copier = CopyEngine(groups, host_pool, args.hicache_io_backend)
    logger.info("hierarchical cache: host pool of %d pages (%.1f MiB, %s), write policy %s, storage %s",
                host_pool.num_pages, host_pool.num_pages * host_pool.bytes_per_page / 2**20, args.hicache_mem_layout,
                args.hicache_write_policy, args.hicache_storage_backend or "none")
    if args.disaggregation_mode == "decode":
        from common.engine.mem.hicache.decode_offload import HiHeldPrefixCache

        return HiHeldPrefixCache(slots, alloc, page, host_pool=host_pool, copier=copier, fence=fence, tp=tp,
                                 load_timeout=args.hicache_load_timeout)
    from common.engine.mem.hicache.hiradix_cache import HiRadixCache

    storage = None
    if args.hicache_storage is not None:
        from common.engine.mem.hicache.storage_tier import StorageTier

        fingerprint = storage_fingerprint(args, model_config, tp, runner.draft_kv)
        storage = StorageTier(args.hicache_storage, host_pool, page, tp, fingerprint, args.hicache_load_timeout)
    return HiRadixCache(slots, alloc, page, host_pool=host_pool, copier=copier, write_policy=args.hicache_write_policy,
                        fence=fence, tp=tp, load_timeout=args.hicache_load_timeout, storage=storage)


def device_groups(runner: ModelRunner) -> list[list[torch.Tensor]]:
    """What the host tier mirrors: every layer of the device pool's slot space, a drafter's (``runner.draft_kv``:
    EAGLE's head, a P/D node's STANDALONE draft) after the target's, so a page loaded back drafts as it did."""
    return slot_space_groups(runner.kv_pool, runner.draft_kv.layers if runner.draft_kv is not None else ())


def host_pool_pages(args: ServerArgs, runner: ModelRunner, per_page: int) -> int:
    """Pages of the host pool (``per_page`` bytes each): --hicache-size GB, else --hicache-ratio x the device pool;
    refused beyond the RAM."""
    if args.hicache_size:
        pages = args.hicache_size * GB // per_page
    else:
        pages = int(runner.kv_pool.num_pages * args.hicache_ratio)
    available = psutil.virtual_memory().available
    if pages * per_page > available * 0.9:
        raise ConfigError(f"the host KV pool ({pages * per_page / GB:.1f} GB from --hicache-size / --hicache-ratio) "
                          f"does not fit in the RAM available ({available / GB:.1f} GB); lower them")
    if pages < 1:
        raise ConfigError(f"--hicache-size / --hicache-ratio give a host KV pool of {pages} pages; raise them")
    if pages <= runner.kv_pool.num_pages and args.disaggregation_mode != "decode":
        logger.warning("the host KV pool (%d pages) is not larger than the device pool (%d): the host tier keeps "
                       "less than the device holds", pages, runner.kv_pool.num_pages)
    return pages


def storage_fingerprint(args: ServerArgs, model_config: ModelConfig, tp: TPGroup,
                        draft_kv: DraftKV | None = None) -> dict[str, object]:
    """What a stored page's bytes depend on: the model (the KV compatibility fingerprint of the bootstrap check), the
    drafter whose KV layers a page holds too (its fingerprint in that check; none: the keys of a node without one),
    the serving dtype, the page size and this rank's share of the KV heads."""
    return {**model_config.fingerprint(), **(draft_kv.fingerprint if draft_kv is not None else {}),
            "serving_dtype": args.dtype, "page_size": args.page_size, "tp_size": tp.tp_size, "tp_rank": tp.tp_rank}
