"""Host staging of KV pages for byte-stream transports (``tcp`` on GPU buffers; on CPU buffers when forced).

A staged job travels in segments of at most ``segment_pages`` pages (the last one may be shorter). One segment's
payload is exactly ``common.engine.kernels.kv_pages``' staging tensor for its pages::

    segment k = [buffer b (K0, V0, K1, V1, ...)] [page i of the segment] [page_size] [heads] [head_dim]
    (heads = the job's head slice, or all of the rank's heads)

Sender, per segment: ``gather_pages`` into a device staging tensor, one copy into a pinned host buffer, send.
Receiver, per segment: land in a pinned host buffer, one copy to the device, ``scatter_pages``. Two host (and
device) buffers per side alternate, so segment k+1 is gathered and copied while segment k is on the wire
(sender), and segment k is copied and scattered while segment k+1 arrives (receiver). On CPU buffers the host
buffer is the staging tensor itself (no device copy): the same byte layout, which lets CPU CI prove the path.

Streams: device work runs on the stager's own CUDA stream. The sender's stream first waits for the device's
default stream (the forward pass that wrote the pages was enqueued there before the job was submitted); the
receiver's stream also waits for the default stream first, and is synchronized before ``receive`` returns, so the
pages are in the pool before the ack is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from common.engine.kernels.kv_pages import gather_pages, gather_pages_ref, scatter_pages, scatter_pages_ref
from kvtransfer.args import KVArgs

DEFAULT_SEGMENT_BYTES = 16 << 20

Heads = tuple[int, int] | None  # (first head on this side, heads); None = all of this rank's heads


def expand_pages(runs: Sequence[tuple[int, int]]) -> list[int]:
    """The page numbers of (first page, pages) runs, in order."""
    return [p + i for p, n in runs for i in range(n)]


class PageStager:
    """Staging buffers and the pipeline of one sending or receiving thread (not thread-safe: one user)."""

    def __init__(self, args: KVArgs, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        self.args = args
        self.buffers = [buf for pair in zip(args.k_buffers, args.v_buffers, strict=True) for buf in pair]
        self.device = self.buffers[0].device
        self.on_device = self.device.type == "cuda"
        whole_page = len(self.buffers) * args.item_len
        self.capacity = max(segment_bytes, whole_page)  # at least one whole page of every buffer
        self.host = [torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.on_device) for _ in range(2)]
        self.dev: list[torch.Tensor] = []
        self.events: list[torch.cuda.Event] = []
        self.stream: torch.cuda.Stream | None = None
        if self.on_device:
            self.dev = [torch.empty(self.capacity, dtype=torch.uint8, device=self.device) for _ in range(2)]
            self.events = [torch.cuda.Event() for _ in range(2)]
            self.stream = torch.cuda.Stream(self.device)

    # ---- geometry (both sides derive the same numbers from the header) ---------------------------------------
    def page_bytes(self, num_heads: int) -> int:
        """Payload bytes of one page over every buffer, ``num_heads`` heads per slot."""
        a = self.args
        return len(self.buffers) * a.page_size * num_heads * a.head_dim * self.buffers[0].element_size()

    def segment_pages(self, num_heads: int) -> int:
        return max(1, self.capacity // self.page_bytes(num_heads))

    def _views(self, heads: Heads) -> list[torch.Tensor]:
        return self.buffers if heads is None else [b[:, heads[0]:heads[0] + heads[1]] for b in self.buffers]

    def _staging(self, flat: torch.Tensor, pages: int, heads: Heads) -> torch.Tensor:
        a = self.args
        nh = a.kv_heads if heads is None else heads[1]
        nbytes = pages * self.page_bytes(nh)
        return flat[:nbytes].view(a.dtype).view(len(self.buffers), pages, a.page_size, nh, a.head_dim)

    def _ids(self, pages: list[int]) -> torch.Tensor:
        ids = torch.tensor(pages, dtype=torch.int64)
        return ids.to(self.device, non_blocking=True) if self.on_device else ids

    # ---- sender ------------------------------------------------------------------------------------------------
    def send(self, pages: list[int], heads: Heads, segment_pages: int, send: Callable[[memoryview], None]) -> None:
        """Gather ``pages`` (source side) segment by segment and hand each segment's bytes to ``send``."""
        if not pages:
            return
        # Head slices are strided views: the torch reference handles them; the kernel's contract is whole slots.
        gather = gather_pages if heads is None else gather_pages_ref
        views = self._views(heads)
        starts = list(range(0, len(pages), segment_pages))
        ids = None
        if self.on_device:
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.default_stream(self.device))
            with torch.cuda.stream(self.stream):
                ids = self._ids(pages)

        def enqueue(k: int) -> None:
            lo, hi = starts[k], min(starts[k] + segment_pages, len(pages))
            slot = k % 2
            if not self.on_device:
                gather(views, torch.tensor(pages[lo:hi], dtype=torch.int64), self.args.page_size,
                       self._staging(self.host[slot], hi - lo, heads))
                return
            assert self.stream is not None and ids is not None
            with torch.cuda.stream(self.stream):
                staged = self._staging(self.dev[slot], hi - lo, heads)
                gather(views, ids[lo:hi], self.args.page_size, staged)
                nbytes = staged.numel() * staged.element_size()
                self.host[slot][:nbytes].copy_(self.dev[slot][:nbytes], non_blocking=True)
                self.events[slot].record(self.stream)

        enqueue(0)
        for k, lo in enumerate(starts):
            if k + 1 < len(starts):
                enqueue(k + 1)  # its host buffer held segment k-1, already sent
            slot = k % 2
            if self.on_device:
                self.events[slot].synchronize()
            n = min(segment_pages, len(pages) - lo)
            staged = self._staging(self.host[slot], n, heads)
            send(memoryview(staged.reshape(-1).view(torch.uint8).numpy()))

    # ---- receiver ----------------------------------------------------------------------------------------------
    def receive(self, pages: list[int], heads: Heads, segment_pages: int,
                recv: Callable[[memoryview], None]) -> None:
        """Land ``pages`` (destination side) segment by segment: ``recv`` fills each segment's bytes."""
        scatter = scatter_pages if heads is None else scatter_pages_ref
        views = self._views(heads)
        ids = None
        if self.on_device and pages:
            assert self.stream is not None
            # earlier device work on the destination pages (a previous owner's reads) comes first
            self.stream.wait_stream(torch.cuda.default_stream(self.device))
            with torch.cuda.stream(self.stream):
                ids = self._ids(pages)
        for k, lo in enumerate(range(0, len(pages), segment_pages)):
            hi, slot = min(lo + segment_pages, len(pages)), k % 2
            if self.on_device:
                self.events[slot].synchronize()  # segment k-2's copy out of this host buffer is done
            host = self._staging(self.host[slot], hi - lo, heads)
            recv(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
            if not self.on_device:
                scatter(views, torch.tensor(pages[lo:hi], dtype=torch.int64), self.args.page_size, host)
                continue
            assert self.stream is not None and ids is not None
            with torch.cuda.stream(self.stream):
                dev = self._staging(self.dev[slot], hi - lo, heads)
                dev.copy_(host, non_blocking=True)
                scatter(views, ids[lo:hi], self.args.page_size, dev)
                self.events[slot].record(self.stream)
        if self.stream is not None:
            self.stream.synchronize()

    def discard(self, nbytes: int, recv: Callable[[memoryview], None]) -> None:
        """Read and drop ``nbytes`` of a refused payload through the host buffers."""
        while nbytes > 0:
            n = min(nbytes, self.capacity)
            recv(memoryview(self.host[0][:n].numpy()))
            nbytes -= n
