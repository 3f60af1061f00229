"""The page-copy kernel alone (``copy_pages``, what ``shm`` runs over CUDA IPC) against a device copy, in one process.

The request of ``benchmarks/kv_transfer.py`` (4096 tokens, 32 layers, 8 KV heads, head dim 128, bf16, page 16:
512 MiB in runs of 4 pages at random places): ``copy_pages`` with its 16-byte-vector hint (``ALIGNED``, the
default for aligned pools) and without it, against one contiguous ``copy_`` of the same bytes. CUDA events time
each rep; median of ``--reps`` after one warm-up. On CPU the torch reference runs (plumbing only).

    python -m benchmarks.kv_copy_kernel [--device cuda] [--tokens 4096] [--reps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.kv_workload import HEAD_DIM, HEADS, LAYERS, PAGE, Geometry, page_tables
from common.engine.kernels.kv_pages import buffer_table, copy_pages_ref


def _time(fn: Callable[[], None], reps: int, cuda: bool) -> float:
    times = []
    for _ in range(reps + 1):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default="")
    opts = parser.parse_args()
    cuda = opts.device == "cuda"
    geom = Geometry(opts.tokens, "cuda:0" if cuda else "cpu")
    shape = (geom.pool_pages * PAGE, HEADS, HEAD_DIM)
    src = [torch.randn(shape, device=geom.device).to(torch.bfloat16) for _ in range(2 * LAYERS)]
    dst = [torch.zeros_like(t) for t in src]
    src_pages, (dst_pages,) = page_tables("paged", 11, geom)
    ids = torch.tensor([src_pages, dst_pages], dtype=torch.int64, device=geom.device)
    flat_src = torch.empty(geom.nbytes, dtype=torch.uint8, device=geom.device)
    flat_dst = torch.empty_like(flat_src)
    sides: dict[str, Callable[[], None]] = {"device_copy": lambda: flat_dst.copy_(flat_src)}
    if cuda:
        from common.engine.kernels import kv_pages_triton as k

        tables = buffer_table(src), buffer_table(dst)
        row = PAGE * HEADS * HEAD_DIM
        n = ids.shape[1]
        assert k._aligned([*src, *dst], row)

        def launch(aligned: bool) -> None:
            k._copy_pages_direct[(n, len(src), row // 4096)](*tables, ids, src[0], n, row, BLOCK=4096, ALIGNED=aligned)
        sides["copy_pages"] = lambda: launch(True)
        sides["copy_pages_unhinted"] = lambda: launch(False)
    else:
        sides["copy_pages"] = lambda: copy_pages_ref(src, dst, ids, PAGE)
    gbps = {name: geom.nbytes / _time(fn, opts.reps, cuda) / 1e9 for name, fn in sides.items()}
    for s_buf, d_buf in zip(src, dst, strict=True):  # the copy is right, not just fast
        sp, dp = s_buf.view(-1, PAGE, HEADS, HEAD_DIM), d_buf.view(-1, PAGE, HEADS, HEAD_DIM)
        if not torch.equal(sp[ids[0]], dp[ids[1]]):
            raise RuntimeError("copy_pages: destination pages differ from the source pages")
    for name, v in gbps.items():
        print(f"{name:22s} {v:9.1f} GB/s  ({v / gbps['device_copy']:.2f}x the device copy)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": geom.device, "mib": geom.nbytes / 2**20, "gbps": gbps}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
