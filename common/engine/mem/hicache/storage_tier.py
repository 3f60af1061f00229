"""``StorageTier``: the hierarchical cache's third tier, over a storage backend shared by the nodes of one model.

    write behind   every page copied to the host (write-through, write-back) is stored too, by a writer thread,
                   from the copy's own staging buffer (bounded: past one host pool's worth of pending bytes a write
                   is dropped, never waited for)
    prefetch       a request whose cached prefix (device + host) ends well before its prompt does looks the rest
                   up by key: a reader thread reads consecutive pages into host pages until the first miss; when
                   the read ends (``settle``, each step) they join the tree as host-only nodes and the request's
                   next match loads them to the device like any host hit
    waiting        --hicache-storage-prefetch-policy: best_effort (the request is scheduled as usual; what the
                   read brings serves later requests), wait_complete (it waits for the read), timeout (it waits
                   until prefetch_timeout_base + prefetch_timeout_per_ki_token per 1024 tokens, then the read stops
                   at its next page). Whatever the policy, a request waits at most --hicache-load-timeout: then the
                   read is given up (``expired``; the request computes its prompt) and told to stop; its host pages
                   stay reserved until the reader has left it, and no new read starts meanwhile (it would queue
                   behind that one)

Keys: the hash chain of ``storage.base``, seeded with the storage fingerprint (model, a drafter whose KV layers the
pages hold, serving dtype, page size, TP shard), so nodes of one model (and draft) share pages and a node of another
model, or with another draft or none, never reads them. A record that fails its check
reads as a miss (recomputed) and is removed. With TP, a read counts as done with the MIN of pages every rank read.
"""

from __future__ import annotations

import array
import hashlib
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from common.engine.distributed import TPGroup
from common.engine.mem.hicache.host_pool import HostKVPool, Staging
from common.engine.mem.hicache.storage import open_backend
from common.engine.mem.hicache.storage.base import decode_record, encode_record
from common.engine.mem.hicache.tree import HiTreeNode
from common.hicache_flags import StorageOptions

if TYPE_CHECKING:
    from common.engine.req import Req

logger = logging.getLogger(__name__)
REMEMBERED_RIDS = 4096  # requests whose prefetch was tried (one try each) and their storage credit


class HostTree(Protocol):
    """What the storage tier asks of the tree it feeds (``HiRadixCache``)."""

    def alloc_host(self, num_pages: int) -> torch.Tensor | None: ...

    def insert_host(self, prefix: list[int], tokens: list[int], host_pages: torch.Tensor, keys: list[bytes]) -> int:
        ...


@dataclass(eq=False)
class PrefetchOp:
    rid: str
    prefix: list[int]  # tokens already in the tree when it started (the pages hang below them)
    tokens: list[int]  # the tokens it looks up, whole pages
    keys: list[bytes]
    host_pages: torch.Tensor
    deadline: float  # the timeout policy's: the read stops at its next page
    give_up: float  # --hicache-load-timeout: the request stops waiting
    expired: bool = False  # given up on (agreed over the TP group)
    n_read: int = 0  # pages read so far (the reader's count)
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


class StorageTier:
    def __init__(self, options: StorageOptions, host_pool: HostKVPool, page_size: int, tp: TPGroup,
                 fingerprint: dict[str, Any], load_timeout: float) -> None:
        self.options = options
        self.load_timeout = load_timeout
        self.host_pool = host_pool
        self.page_size = page_size
        self.tp = tp
        self.seed = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).digest()
        self.backend = open_backend(options)
        where = str(options.file_path.resolve()) if options.backend == "file" else (
            options.backend_config["master_server_address"])
        self.identity = f"{options.backend}:{where}"  # nodes that report the same one share their pages
        self.ops: dict[str, PrefetchOp] = {}  # rid -> its read, in start order
        self.tried: OrderedDict[str, int] = OrderedDict()  # rid -> tokens its read brought (its storage credit)
        self.read_bytes = 0
        self.write_bytes = 0
        self.dropped_pages = 0  # not written behind: the queue held a host pool's worth already
        self.timeouts = 0  # reads given up at --hicache-load-timeout
        self._pending_write_bytes = 0
        self._write_limit = host_pool.num_pages * host_pool.bytes_per_page
        self._lock = threading.Lock()
        self._reads: queue.Queue[PrefetchOp | None] = queue.Queue()
        self._writes: queue.Queue[tuple[list[bytes], Staging] | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._read_loop, name="pdcluster-hicache-read", daemon=True),
                         threading.Thread(target=self._write_loop, name="pdcluster-hicache-write", daemon=True)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        for op in self.ops.values():
            op.stop.set()
        self._reads.put(None)
        self._writes.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self.backend.close()

    # -- keys ------------------------------------------------------------------------------------------------------
    def chain(self, prev: bytes, tokens: list[int]) -> list[bytes]:
        keys, ps = [], self.page_size
        for start in range(0, len(tokens) - ps + 1, ps):
            prev = hashlib.sha256(prev + array.array("i", tokens[start: start + ps]).tobytes()).digest()
            keys.append(prev)
        return keys

    def page_keys(self, parent: HiTreeNode, tokens: list[int]) -> list[bytes]:
        """Keys of the pages of ``tokens``, which continue ``parent``'s path."""
        return self.chain(parent.page_hashes[-1] if parent.page_hashes else self.seed, tokens)

    # -- write behind ----------------------------------------------------------------------------------------------
    def write_behind_hook(self, keys: list[bytes]) -> Callable[[Staging], None]:
        """What a host write runs on the copy thread with its staged pages: queue them for the store."""
        def stage(staging: Staging) -> None:
            nbytes = len(keys) * self.host_pool.bytes_per_page
            with self._lock:
                if self._pending_write_bytes + nbytes > self._write_limit:
                    self.dropped_pages += len(keys)
                    return
                self._pending_write_bytes += nbytes
            self._writes.put((keys, staging))
        return stage

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            keys, staging = item
            try:
                for i, key in enumerate(keys):
                    name = key.hex()
                    if not self.backend.exists(name):
                        payload = self.host_pool.staged_page_bytes(staging, i)
                        if self.backend.set(name, encode_record(key, payload)):
                            self.write_bytes += len(payload)
            except Exception:  # a store that fails a write loses that page only (it is recomputed when missed)
                logger.exception("hicache storage: a write of %d pages failed", len(keys))
            with self._lock:
                self._pending_write_bytes -= len(keys) * self.host_pool.bytes_per_page

    # -- prefetch --------------------------------------------------------------------------------------------------
    def prefetch_waits(self, cache: HostTree, req: Req, key: list[int], matched: int, node: HiTreeNode) -> bool:
        """Start a read of what follows the tree's ``matched`` tokens of ``key`` (``node`` ends them), once per
        request; whether the request waits for it (the prefetch policy)."""
        op = self.ops.get(req.rid)
        if op is None:
            remaining = len(key) - matched
            if req.rid in self.tried or remaining < max(self.options.prefetch_threshold, self.page_size) or any(
                    o.expired for o in self.ops.values()):
                return False
            self._remember(req.rid, 0)
            keys = self.chain(node.page_hashes[-1] if node.page_hashes else self.seed, key[matched:])
            host = cache.alloc_host(len(keys))
            if host is None:
                return False
            budget = self.options.prefetch_timeout_base + self.options.prefetch_timeout_per_ki_token * (
                remaining / 1024)
            now = time.monotonic()
            op = PrefetchOp(req.rid, list(key[:matched]), list(key[matched:]), keys, host, now + budget,
                            now + self.load_timeout)
            self.ops[req.rid] = op
            self._reads.put(op)
        if op.expired:
            return False
        policy = self.options.prefetch_policy
        if policy == "timeout" and time.monotonic() > op.deadline:
            op.stop.set()  # the reader stops at its next page; the request waits for that
        return policy != "best_effort"

    def _read_loop(self) -> None:
        page_bytes = self.host_pool.bytes_per_page
        while (op := self._reads.get()) is not None:
            try:
                for i, key in enumerate(op.keys):
                    if op.stop.is_set():
                        break
                    name = key.hex()
                    record = self.backend.get(name)
                    payload = decode_record(key, record, page_bytes)
                    if payload is None:
                        if record is not None:
                            logger.warning("hicache storage: page %s failed its check; it is recomputed", name)
                            self.backend.remove(name)
                        break
                    self.host_pool.set_page_bytes(int(op.host_pages[i]), payload)
                    op.n_read = i + 1
                    self.read_bytes += page_bytes
            except Exception:  # a failing store reads as a miss from here on
                logger.exception("hicache storage: a prefetch of %d pages failed", len(op.keys))
            op.done.set()

    def settle(self, cache: HostTree) -> None:
        """Finished reads join the tree (each step)."""
        if not self.ops:
            return
        ops, now = list(self.ops.values()), time.monotonic()
        late = [-int(now > op.give_up) for op in ops]  # MIN of the negation: whether any rank is late
        flags = [int(op.done.is_set()) for op in ops] + [op.n_read for op in ops] + late
        if self.tp.tp_size > 1:  # the same reads end with the same pages on every rank
            flags = self.tp.all_reduce_min(torch.tensor(flags, dtype=torch.int64)).tolist()
        n_ops = len(ops)
        for op, done, n, over in zip(ops, flags[:n_ops], flags[n_ops: 2 * n_ops], flags[2 * n_ops:], strict=True):
            if not done:
                if over and not op.expired:
                    logger.warning("hicache storage: a prefetch of %d pages ran past --hicache-load-timeout (%.1f s); "
                                   "its request computes them", len(op.keys), self.load_timeout)
                    op.expired = True
                    op.stop.set()
                    self.timeouts += 1
                continue
            del self.ops[op.rid]
            joined = cache.insert_host(op.prefix, op.tokens[: n * self.page_size], op.host_pages[:n], op.keys[:n])
            if n < len(op.host_pages):
                self.host_pool.free(op.host_pages[n:])
            self._remember(op.rid, joined)

    def take_credit(self, rid: str) -> int:
        """Tokens the request's own read brought into the tree (counted once, as storage hits)."""
        credit = self.tried.get(rid, 0)
        if credit:
            self.tried[rid] = 0
        return credit

    def _remember(self, rid: str, tokens: int) -> None:
        self.tried[rid] = tokens
        self.tried.move_to_end(rid)
        while len(self.tried) > REMEMBERED_RIDS:
            self.tried.popitem(last=False)
