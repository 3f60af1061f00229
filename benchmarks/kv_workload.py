"""The request ``benchmarks/kv_transfer.py`` (and ``kv_copy_kernel.py``) moves: a 32-layer, 8-KV-head, head-dim-128,
bf16 model's KV, page size 16, in ``Geometry``'s pools, and its source and destination page tables."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvtransfer.args import KVArgs

LAYERS, HEADS, HEAD_DIM, PAGE, RUN = 32, 8, 128, 16, 4
SRC_SEED = 7


@dataclass(frozen=True)
class Geometry:
    """Requests of ``tokens`` tokens out of a pool of ``slots`` + 1 requests' pages (plus the padding page), on
    ``device``: up to ``slots`` requests in flight on disjoint destination pages."""

    tokens: int = 4096
    device: str = "cpu"
    slots: int = 1

    @property
    def req_pages(self) -> int:
        return self.tokens // PAGE

    @property
    def pool_pages(self) -> int:
        return (self.slots + 1) * self.req_pages

    @property
    def nbytes(self) -> int:
        return 2 * LAYERS * self.tokens * HEADS * HEAD_DIM * 2


def make_pool(seed: int | None, geom: Geometry, device: str | None = None) -> KVArgs:
    device = device or geom.device
    g = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    shape = (geom.pool_pages * PAGE, HEADS, HEAD_DIM)

    def buf() -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        if g is not None:
            t.view(torch.int16).random_(-(2**15), 2**15 - 1, generator=g)
        else:
            t.zero_()
        return t

    return KVArgs(tuple(buf() for _ in range(LAYERS)), tuple(buf() for _ in range(LAYERS)), page_size=PAGE,
                  total_kv_heads=HEADS, num_metadata_slots=16)


def page_tables(mode: str, seed: int, geom: Geometry, inflight: int = 1) -> tuple[list[int], list[list[int]]]:
    """The source pages and ``inflight`` disjoint destination tables of one request each."""
    n = geom.req_pages
    if mode == "contiguous":
        return list(range(1, n + 1)), [list(range(1 + k * n, 1 + (k + 1) * n)) for k in range(inflight)]
    rng = random.Random(seed)
    slots = [1 + RUN * k for k in range((geom.pool_pages - 1) // RUN)]

    def table(count: int) -> list[int]:
        return [start + i for start in rng.sample(slots, count // RUN) for i in range(RUN)]

    dst = table(inflight * n)
    return table(n), [dst[k * n:(k + 1) * n] for k in range(inflight)]


def runs_of(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    from kvtransfer.pages import coalesce_runs
    return [(r.src_page, r.dst_page, r.num_pages) for r in coalesce_runs(src, dst)]
