"""Decode attention over the paged KV pool: one layer's attention call, per backend, batch x context.

    python -m benchmarks.attention_kernels [--quick] [--device cpu|cuda] [--out benchmarks/results/attention_kernels]

Paths (each includes writing the new token's K/V to the pool, as a layer does):
- ``torch-gather``: ``TorchAttentionBackend(decode_chunk_bytes=None)`` (gathers the whole batch's K/V, then one
  padded SDPA);
- ``torch-chunked`` (CPU): ``TorchAttentionBackend`` as the engine builds it (pages of ``DECODE_CHUNK_BYTES`` of
  requests at a time into reusable scratch, one SDPA per chunk);
- ``torch-paged``: ``common.engine.kernels.paged_decode_torch`` (blocks of pages, online softmax, no [B, Lk] copy);
- ``triton`` (CUDA only): ``TritonAttentionBackend`` (the paged split-K decode kernel).
Per-forward metadata (built once for all layers) is timed apart from the per-layer call. On CPU the timed calls
cycle over the buffers of 8 layers (the ``small`` model's), so K/V come from memory as in a decode step, not from
the cache the previous call left warm. Reported: median
per-layer time, decode tokens/s of one layer (batch / time), K/V bytes read / time against the device's peak
(CUDA: nominal HBM peak by device name, and a measured device-to-device copy).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.kernels.decode_attention import decode_attention_ref
from common.engine.kernels.paged_decode_torch import page_table, paged_decode_torch
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.model.attention import DECODE_CHUNK_BYTES, TorchAttentionBackend

NOMINAL_PEAK_GBS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}  # HBM, SXM parts


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs."""
    return statistics.median(_times(fn, device, repeats, warmup))


def _times(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Seconds of each of ``repeats`` runs (the fastest is the one least disturbed on a shared machine)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def _batch(bs: int, ctx: int, heads: int, kv_heads: int, d: int, page: int, dtype: torch.dtype,
           device: torch.device, layers: int) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode batch of ``bs`` requests with ``ctx`` keys each (the last one new), pages shuffled over the pool."""
    pages_per_req = -(-ctx // page)
    num_pages = bs * pages_per_req + 1
    pool = MHATokenToKVPool(num_pages, page, dtype, kv_heads, d, layers, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen, device=device))
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))[: bs * pages_per_req] + 1
    pos = torch.arange(ctx)
    req_to_token = torch.zeros(bs + 1, pages_per_req * page + 8, dtype=torch.int64)
    for i in range(bs):
        req_pages = perm[i * pages_per_req : (i + 1) * pages_per_req]
        req_to_token[i + 1, :ctx] = req_pages[pos // page] * page + pos % page
    req_to_token = req_to_token.to(device)
    i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=i64([0] * bs), positions=i64([ctx - 1] * bs),
        out_cache_loc=req_to_token[1:, ctx - 1].clone(), req_pool_indices=i64(list(range(1, bs + 1))),
        seq_lens=i64([ctx] * bs), extend_lens=i64([1] * bs), prefix_lens=i64([ctx - 1] * bs),
        req_to_token=req_to_token, seq_lens_cpu=[ctx] * bs, extend_lens_cpu=[1] * bs,
        prefix_lens_cpu=[ctx - 1] * bs, kv_pool=pool, attn_backend=None,
    )
    q = torch.randn(bs, heads, d, generator=gen, device=device).to(dtype)
    k = torch.randn(bs, kv_heads, d, generator=gen, device=device).to(dtype)
    v = torch.randn(bs, kv_heads, d, generator=gen, device=device).to(dtype)
    return fb, q, k, v


def _run_case(path: str, fb: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              heads: int, kv_heads: int, d: int, repeats: int) -> tuple[dict[str, float], torch.Tensor]:
    device = q.device
    pool = fb.kv_pool
    calls = itertools.count()

    def next_layer() -> int:
        return next(calls) % pool.num_layers

    if path == "torch-paged":
        page = pool.page_size

        def meta() -> Any:
            return page_table(fb.req_to_token, fb.req_pool_indices, max(fb.seq_lens_cpu), page)

        pages = meta()

        def layer() -> torch.Tensor:
            i = next_layer()
            pool.set_kv_buffer(i, fb.out_cache_loc, k, v)
            return paged_decode_torch(q, pool.k_buffer[i], pool.v_buffer[i], pages, fb.seq_lens, page, d**-0.5)
    else:
        if path == "triton":
            from common.engine.model.triton_backend import TritonAttentionBackend

            backend: Any = TritonAttentionBackend(heads, kv_heads, d, None, device)
        else:
            chunk = DECODE_CHUNK_BYTES if path == "torch-chunked" else None
            backend = TorchAttentionBackend(heads, kv_heads, d, decode_chunk_bytes=chunk)
        fb.attn_backend = backend

        def meta() -> Any:
            fb.attn_metadata = None
            backend.init_forward_metadata(fb)

        meta()

        def layer() -> torch.Tensor:
            return backend.forward(q, k, v, next_layer(), fb)
    t_meta = _timed(meta, device, repeats)
    layer_times = _times(layer, device, repeats, 2)
    t_layer, t_layer_min = statistics.median(layer_times), min(layer_times)
    calls = itertools.count()  # the returned output is layer 0's, which the reference reads
    return {"metadata_s": t_meta, "layer_s": t_layer, "layer_min_s": t_layer_min}, layer().view(q.shape)


def _copy_bandwidth_gbs(device: torch.device) -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = _timed(lambda: y.copy_(x), device, 10)
    return 2 * x.numel() / t / 1e9  # read + write


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats (CPU: about half a minute)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/attention_kernels")
    a = p.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:  # the 1B preset's attention: 32 query / 8 KV heads of 128, bf16
        heads, kv_heads, d, dtype, page = 32, 8, 128, torch.bfloat16, 16
        batches, contexts = ([1, 32, 128], [512, 4096])
        paths = ["torch-gather", "torch-paged", "triton"]
    else:  # the embedded `small` model's attention: 8 query / 2 KV heads of 64, fp32
        heads, kv_heads, d, dtype, page = 8, 2, 64, torch.float32, 16
        batches, contexts = ([1, 8, 32, 64], [160, 512, 2048]) if not a.quick else ([1, 16, 64], [160, 512])
        paths = ["torch-gather", "torch-chunked", "torch-paged"]
    if a.quick and cuda:
        batches, contexts = [1, 32], [512, 4096]
    repeats = a.repeats or (5 if a.quick else 20)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for ctx in contexts:
        for bs in batches:
            fb, q, k, v = _batch(bs, ctx, heads, kv_heads, d, page, dtype, device, 1 if cuda else 8)
            kv_bytes = 2 * bs * ctx * kv_heads * d * itemsize
            ref = None
            for path in paths:
                t, out = _run_case(path, fb, q, k, v, heads, kv_heads, d, repeats)
                if ref is None:
                    ref = decode_attention_ref(q, fb.kv_pool.k_buffer[0], fb.kv_pool.v_buffer[0], fb.req_to_token,
                                               fb.req_pool_indices, fb.seq_lens, d**-0.5)
                err = (out.float() - ref.float()).abs().max().item()
                row = {"path": path, "batch": bs, "context": ctx, **t, "tokens_per_s": bs / t["layer_s"],
                       "kv_gb_per_s": kv_bytes / t["layer_s"] / 1e9, "max_abs_err_vs_ref": err}
                rows.append(row)
                print(f"{path:13s} bs={bs:4d} ctx={ctx:5d}  layer {t['layer_s'] * 1e6:9.1f} us "
                      f"(min {t['layer_min_s'] * 1e6:9.1f})  "
                      f"meta {t['metadata_s'] * 1e6:8.1f} us  {row['tokens_per_s']:10.0f} tok/s  "
                      f"{row['kv_gb_per_s']:7.1f} GB/s  err {err:.1e}", flush=True)
    machine: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                               "torch_threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
                               "torch": torch.__version__}
    if cuda:
        name = torch.cuda.get_device_name(device)
        machine["gpu"] = name
        machine["nominal_peak_gb_per_s"] = next((v for k, v in NOMINAL_PEAK_GBS.items() if k in name), None)
        machine["measured_copy_gb_per_s"] = _copy_bandwidth_gbs(device)
        for row in rows:
            if machine["nominal_peak_gb_per_s"]:
                row["fraction_of_peak"] = row["kv_gb_per_s"] / machine["nominal_peak_gb_per_s"]
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine,
              "config": {"heads": heads, "kv_heads": kv_heads, "head_dim": d, "dtype": str(dtype), "page_size": page,
                         "repeats": repeats, "quick": a.quick}, "rows": rows}
    out = Path(f"{a.out}_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
