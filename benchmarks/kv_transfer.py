"""KV transfer throughput per backend, cross-process, against single-thread memcpy and a raw TCP socket.

Workload: one request of 4096 tokens of a 32-layer, 8-KV-head, head-dim-128, bf16 model (512 MiB of K and V),
page size 16 (32 KiB per page per layer), out of a 512-page pool per side (1 GiB):

    contiguous: pages 1..256 -> pages 1..256            (one run per layer per K/V)
    paged:      64 runs of 4 pages per layer per K/V at random run-aligned places, different on the two sides

Each backend: prefill ``KVManager`` in a child process, decode ``KVManager`` here. A rep is timed on the prefill
side from ``send(all pages, last=True)`` to the sender's ``Success`` (which needs decode's confirmation that every
byte and the metadata landed). GB/s = 536,870,912 B / seconds (1 GB = 1e9 B). Median of ``--reps`` after one
warm-up. Baselines in the same run: ``ctypes.memmove`` of the same runs in one thread, and a raw TCP socket
(``sendmsg``/``recvmsg_into`` of the same runs, 64 iovecs per call) between two processes.

    python benchmarks/kv_transfer.py [--backends tcp,shm,...] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import random
import socket
import statistics
import sys
import time
from dataclasses import replace

import torch

from kvtransfer.args import KVArgs, KVTransferConfig
from kvtransfer.registry import BACKENDS

LAYERS, HEADS, HEAD_DIM, PAGE, TOKENS, POOL_PAGES, RUN = 32, 8, 128, 16, 4096, 512, 4
REQ_PAGES = TOKENS // PAGE
NBYTES = 2 * LAYERS * TOKENS * HEADS * HEAD_DIM * 2
SRC_SEED = 7


def make_pool(seed: int | None) -> KVArgs:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (POOL_PAGES * PAGE, HEADS, HEAD_DIM)

    def buf() -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.bfloat16)
        if g is not None:
            t.view(torch.int16).random_(-(2**15), 2**15 - 1, generator=g)
        else:
            t.zero_()
        return t

    return KVArgs(tuple(buf() for _ in range(LAYERS)), tuple(buf() for _ in range(LAYERS)), page_size=PAGE,
                  total_kv_heads=HEADS, num_metadata_slots=16)


def page_tables(mode: str, seed: int) -> tuple[list[int], list[int]]:
    if mode == "contiguous":
        pages = list(range(1, REQ_PAGES + 1))
        return pages, pages
    rng = random.Random(seed)
    slots = [1 + RUN * k for k in range((POOL_PAGES - 1) // RUN)]

    def table() -> list[int]:
        return [start + i for start in rng.sample(slots, REQ_PAGES // RUN) for i in range(RUN)]

    return table(), table()


def runs_of(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    from kvtransfer.pages import coalesce_runs
    return [(r.src_page, r.dst_page, r.num_pages) for r in coalesce_runs(src, dst)]


def bench_memcpy(src: KVArgs, dst: KVArgs, runs: list[tuple[int, int, int]], reps: int) -> list[float]:
    item = src.item_len
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for s_buf, d_buf in zip((*src.k_buffers, *src.v_buffers), (*dst.k_buffers, *dst.v_buffers), strict=True):
            sp, dp = s_buf.data_ptr(), d_buf.data_ptr()
            for s, d, n in runs:
                ctypes.memmove(dp + d * item, sp + s * item, n * item)
        times.append(time.perf_counter() - t0)
    return times[1:]


# ---- raw TCP baseline ---------------------------------------------------------------------------------------------
def _views(args: KVArgs, pages: list[tuple[int, int]]) -> list[memoryview]:
    item = args.item_len
    out = []
    for buf in (*args.k_buffers, *args.v_buffers):
        mv = memoryview(buf.reshape(-1).view(torch.uint8).numpy())
        out += [mv[p * item:(p + n) * item] for p, n in pages]
    return out


def _raw_receiver(port_q: mp.Queue, runs: list[tuple[int, int, int]], reps: int) -> None:
    from kvtransfer.backends.tcp import _recv_views
    dst = make_pool(None)
    views = _views(dst, [(d, n) for _, d, n in runs])
    server = socket.create_server(("127.0.0.1", 0))
    port_q.put(server.getsockname()[1])
    conn, _ = server.accept()
    for _ in range(reps + 1):
        _recv_views(conn, views)
        conn.sendall(b"k")
    conn.close()


def bench_raw_tcp(src: KVArgs, runs: list[tuple[int, int, int]], reps: int) -> list[float]:
    from kvtransfer.backends.tcp import _send_views
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_raw_receiver, args=(q, runs, reps), daemon=True)
    proc.start()
    sock = socket.create_connection(("127.0.0.1", q.get(timeout=120)))
    views = _views(src, [(s, n) for s, _, n in runs])
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        _send_views(sock, views)
        sock.recv(1)
        times.append(time.perf_counter() - t0)
    sock.close()
    proc.join(30)
    return times[1:]


# ---- backends -------------------------------------------------------------------------------------------------------
def _prefill_child(backend: str, config: KVTransferConfig, src_pages: list[int], rooms: list[int],
                   out: mp.Queue) -> None:
    torch.set_num_threads(1)
    from kvtransfer.bootstrap import BootstrapServer
    from kvtransfer.manager import KVManager
    from kvtransfer.metadata import MetadataRecord
    from kvtransfer.poll import KVPoll
    from kvtransfer.sender import KVSender

    server = BootstrapServer(config.cluster_token)
    port = server.start()
    mgr = KVManager(make_pool(SRC_SEED), config, "prefill", bootstrap_addr=f"127.0.0.1:{port}")
    out.put(("ready", port))
    times = []
    for room in rooms:
        sender = KVSender(mgr, room)
        while sender.poll() < KVPoll.WaitingForInput:
            time.sleep(0.0005)
        sender.init(len(src_pages), 0)
        t0 = time.perf_counter()
        sender.send(src_pages, last=True, metadata=MetadataRecord(room=room, first_token=1))
        while not sender.poll().is_final:
            time.sleep(0.0002)
        times.append(time.perf_counter() - t0)
        if sender.poll() != KVPoll.Success:
            out.put(("failed", sender.failure()))
            return
        sender.clear()
    out.put(("times", times))
    time.sleep(1)
    mgr.close()
    server.stop()


def bench_backend(backend: str, mode: str, src_pages: list[int], dst_pages: list[int], reps: int,
                  src: KVArgs) -> list[float]:
    from kvtransfer.manager import KVManager
    from kvtransfer.poll import KVPoll
    from kvtransfer.receiver import KVReceiver

    config = replace(KVTransferConfig(backend=backend, cluster_token="bench"), transfer_timeout_s=120)
    rooms = [1000 + i for i in range(reps + 1)]
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_prefill_child, args=(backend, config, src_pages, rooms, out), daemon=True)
    proc.start()
    dst = make_pool(None)
    mgr = KVManager(dst, config, "decode")
    try:
        kind, port = out.get(timeout=180)
        for room in rooms:
            receiver = KVReceiver(mgr, room, f"127.0.0.1:{port}")
            receiver.init(0)
            receiver.send_metadata(dst_pages, 0)
            end = time.monotonic() + 180
            while not receiver.poll().is_final and time.monotonic() < end:
                time.sleep(0.0005)
            if receiver.poll() != KVPoll.Success:
                raise RuntimeError(f"{backend}: room {room} {receiver.poll().name}: {receiver.failure()}")
            receiver.clear()
        kind, payload = out.get(timeout=60)
        if kind != "times":
            raise RuntimeError(f"{backend}: prefill side: {payload}")
        if backend != "fake":
            verify(src, dst, src_pages, dst_pages)
        return payload[1:]
    finally:
        mgr.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def verify(src: KVArgs, dst: KVArgs, src_pages: list[int], dst_pages: list[int]) -> None:
    for s_buf, d_buf in zip((*src.k_buffers, *src.v_buffers), (*dst.k_buffers, *dst.v_buffers), strict=True):
        for s, d in zip(src_pages, dst_pages, strict=True):
            if not torch.equal(s_buf[s * PAGE:(s + 1) * PAGE].view(torch.int16),
                               d_buf[d * PAGE:(d + 1) * PAGE].view(torch.int16)):  # bit-exact; NaN patterns too
                raise RuntimeError(f"verification failed: source page {s} -> destination page {d}")


def gbps(times: list[float]) -> float:
    return NBYTES / statistics.median(times) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=",".join(name for name in BACKENDS if name != "fake") + ",fake")
    parser.add_argument("--modes", default="contiguous,paged")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default="")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    src, scratch = make_pool(SRC_SEED), make_pool(None)
    results: dict[str, dict[str, float | str]] = {}
    for mode in opts.modes.split(","):
        src_pages, dst_pages = page_tables(mode, seed=11)
        runs = runs_of(src_pages, dst_pages)
        row = results.setdefault(mode, {})
        row["memcpy"] = gbps(bench_memcpy(src, scratch, runs, opts.reps))
        row["raw_tcp"] = gbps(bench_raw_tcp(src, runs, opts.reps))
        for backend in opts.backends.split(","):
            try:
                row[backend] = gbps(bench_backend(backend, mode, src_pages, dst_pages, opts.reps, src))
            except Exception as exc:  # report the failure in the table and go on with the other backends
                row[backend] = f"error: {exc}"
            print(f"{mode:10s} {backend:6s} {row[backend]}", file=sys.stderr, flush=True)
    print(f"\n512 MiB request, median of {opts.reps} reps, GB/s (ratio to raw TCP sendmsg / to 1-thread memcpy)\n")
    print("| mode | memcpy 1T | raw TCP | " + " | ".join(opts.backends.split(",")) + " |")
    print("|---|---|---|" + "---|" * len(opts.backends.split(",")))
    for mode, row in results.items():
        cells = []
        for backend in opts.backends.split(","):
            v = row[backend]
            cells.append(v if isinstance(v, str) else
                         f"{v:.2f} ({v / row['raw_tcp']:.2f}x / {v / row['memcpy']:.2f}x)")
        print(f"| {mode} | {row['memcpy']:.2f} | {row['raw_tcp']:.2f} | " + " | ".join(cells) + " |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
