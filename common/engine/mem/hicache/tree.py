"""``HiTreeNode``: a radix tree node that knows where its pages are, and the tree's host-tier walks.

A node's tokens live on the device (``value``: KV slots), on the host (``host_pages``: host pool pages), or both::

    state        value      host_pages   loading   meaning
    device       slots      None         None      computed here, no host copy (yet)
    both         slots      pages        None      a host copy exists (``backup`` may still be writing it)
    host         None       pages        None      evicted from the device; a match loads it back
    loading      slots      pages        job       coming back to the device; locked until the job is done

Tree invariants (on top of ``RadixCache``'s):
- The device-resident nodes (``value`` set) form a subtree at the root: a node's ancestors are on the device when
  it is. Device eviction takes device leaves (no child on the device); loads bring back runs below a device node.
- ``lock_ref > 0`` only on device-resident nodes (a running request's path, a load or a write-through in flight).
- ``host_ref > 0`` keeps a host-only node from host eviction while a load of it is being planned.
- ``evictable_size_`` / ``protected_size_`` count device tokens only.
"""

from __future__ import annotations

from typing import Any

import torch

from common.engine.mem.hicache.copy_engine import CopyJob, Fence
from common.engine.mem.radix_cache import TreeNode


class HiTreeNode(TreeNode):
    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = torch.empty(0, dtype=torch.int64)  # type: ignore[assignment]
        self.host_pages: torch.Tensor | None = None
        self.backup: CopyJob | None = None  # the device -> host write filling ``host_pages``
        self.loading: CopyJob | None = None  # the host -> device load filling ``value``
        self.fence: Fence = None  # the batch in flight when its pages were inserted (it may still write one)
        self.page_hashes: list[bytes] | None = None  # storage keys of its pages (storage tier on)
        self.hit_count = 0
        self.host_ref = 0

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def ready(self) -> bool:
        """On the device and usable by a forward (not being loaded)."""
        return self.value is not None and self.loading is None

    @property
    def host_only(self) -> bool:
        return self.value is None

    def pending_fence(self) -> Fence:
        """The batch that may still write this node's device pages, or None once it ran."""
        if self.fence is not None and self.fence.done():
            self.fence = None
        return self.fence

    def settle_backup(self, free_host: Any) -> None:
        """Forget a finished write; a failed one leaves no host copy (``free_host`` takes its pages back)."""
        job = self.backup
        if job is None or not job.done.is_set():
            return
        self.backup = None
        if job.error is not None and self.host_pages is not None:
            free_host(self.host_pages)
            self.host_pages = None


def split_tiers(new: HiTreeNode, child: HiTreeNode, split_len: int, page_size: int) -> None:
    """``new`` takes the first ``split_len`` tokens of ``child``'s pages on every tier, and its copy state."""
    if child.value is not None:
        new.value, child.value = child.value[:split_len], child.value[split_len:]
    else:
        new.value = None
    cut = split_len // page_size
    if child.host_pages is not None:
        new.host_pages, child.host_pages = child.host_pages[:cut], child.host_pages[cut:]
    if child.page_hashes is not None:
        new.page_hashes, child.page_hashes = child.page_hashes[:cut], child.page_hashes[cut:]
    new.backup, new.loading, new.fence = child.backup, child.loading, child.fence
    new.hit_count, new.host_ref = child.hit_count, child.host_ref


def device_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pages of a node's (whole-page) slots, in order."""
    return slots[::page_size] // page_size
