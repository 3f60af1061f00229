"""KV transfer throughput per backend, cross-process, against single-thread memcpy and a raw TCP socket.

Workload: one request of 4096 tokens of a 32-layer, 8-KV-head, head-dim-128, bf16 model (512 MiB of K and V),
page size 16 (32 KiB per page per layer), out of a 512-page pool per side (1 GiB):

    contiguous: pages 1..256 -> pages 1..256            (one run per layer per K/V)
    paged:      64 runs of 4 pages per layer per K/V at random run-aligned places, different on the two sides

Each backend: prefill ``KVManager`` in a child process, decode ``KVManager`` here. A rep is timed on the prefill
side from ``send(all pages, last=True)`` to the sender's ``Success`` (which needs decode's confirmation that every
byte and the metadata landed). GB/s = 536,870,912 B / seconds (1 GB = 1e9 B). Median of ``--reps`` after one
warm-up. ``<backend> at decode`` times the same reps to decode's ``Success`` instead (what a decode scheduler waits
for; with ``shm``'s landing signals it no longer waits for prefill's report of the landing). Baselines in the same run: ``ctypes.memmove`` of the same runs in one thread, and a raw TCP socket
(``sendmsg``/``recvmsg_into`` of the same runs, 64 iovecs per call, no flags) between two processes (the baselines:
``kv_baselines.py``, fixed there so a change to a backend's loops never moves its baseline); with the ``nixl``
or ``ucx`` backend, raw NIXL too: two agents in two processes, one ``initialize_xfer("WRITE")`` of the same page runs
(every layer, K and V) + ``transfer`` + ``check_xfer_state`` until DONE per rep (the handle is built inside the timed
region, as a new request's page table needs; UCX transports from ``UCX_TLS``); with the ``mooncake`` backend, raw
Mooncake too: two ``TransferEngine``s (P2P handshake, TCP protocol) in two processes, one
``batch_transfer_sync_write`` of the same page runs per rep (in batches of 2048 segments, the engine's limit).
Targets: tcp >= 1.0x raw TCP (tcp stripes a job over 2 connections by default; ``--option streams=1`` measures it
on one), shm >= 0.85x memcpy, nixl >= 0.9x raw NIXL, ucx >= 1.0x raw NIXL (same ``UCX_TLS``), mooncake >= 0.9x raw
Mooncake.

``--device cuda``: both pools on ``cuda:0`` (two processes on one GPU; default backends shm and tcp). Baselines in
the same run: an in-process device-to-device copy of the same number of bytes (one contiguous ``copy_``,
synchronized) and the raw TCP socket above (host memory). Targets: shm (CUDA IPC) >= 0.5x the device copy, tcp
(staged through pinned host buffers) >= 0.8x raw TCP. ``--tokens`` shrinks the request (pool = 2x the request).

``--inflight 1,4`` (cuda default; cpu: 1) also measures K requests in flight at once: K rooms sent back to back,
timed from the first ``send`` to the last ``Success``, GB/s = K x 512 MiB over that time (the pools hold K + 1
requests; the baseline is the same). One request alone measures the control path's fixed cost (two processes,
a confirmation round trip: several device copies' worth of a 512 MiB request on a GPU); K in flight
measure the bandwidth a loaded decode node gets, the fixed cost overlapped with other requests' copies.

``--rounds N`` measures each backend and its baseline N times, alternating which goes first, and takes the median
of the N paired ratios for the target (a single pair moves by more than the targets' margins on a shared machine).

    python benchmarks/kv_transfer.py [--device cpu|cuda] [--backends tcp,shm,...] [--modes paged] [--reps 5]
                                     [--rounds 1] [--tokens 4096] [--option stage=always] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

from benchmarks.kv_baselines import (
    bench_device_copy,
    bench_memcpy,
    bench_raw_mooncake,
    bench_raw_nixl,
    bench_raw_tcp,
)
from benchmarks.kv_workload import PAGE, RUN, SRC_SEED, Geometry, make_pool, page_tables, runs_of
from common.kv_backends import KV_TRANSFER_BACKENDS
from kvtransfer.args import KVArgs, KVTransferConfig

# Both sides wait for the room's final state in a sleep-poll loop, as a scheduler does between its iterations. On
# 2 cores the sender and the receiver each fill one, so a poller's CPU comes out of the transfer (the raw baselines
# block in recv instead); a shorter period costs more of it (benchmarks/pages/kv_transfer.md).
POLL_S = 0.0001  # both sides poll for the final state: on a GPU a 1 ms poll alone outlasts a 512 MiB device copy


# ---- backends -------------------------------------------------------------------------------------------------------
def _prefill_child(backend: str, config: KVTransferConfig, src_pages: list[int], rooms: list[list[int]],
                   out: mp.Queue, geom: Geometry) -> None:
    torch.set_num_threads(1)
    from kvtransfer.bootstrap import BootstrapServer
    from kvtransfer.manager import KVManager
    from kvtransfer.metadata import MetadataRecord
    from kvtransfer.poll import KVPoll
    from kvtransfer.prefill_rooms import PrefillRooms
    from kvtransfer.sender import KVSender

    server = BootstrapServer(config.cluster_token)
    port = server.start()
    mgr = KVManager(make_pool(SRC_SEED, geom), config, PrefillRooms, bootstrap_addr=f"127.0.0.1:{port}")
    out.put(("ready", port))
    times, starts = [], []
    for group in rooms:  # one rep: the group's rooms in flight at once
        senders = [KVSender(mgr, room) for room in group]
        for slot, sender in enumerate(senders):
            while sender.poll() < KVPoll.WaitingForInput:
                time.sleep(POLL_S)
            sender.init(len(src_pages), slot)
        t0 = time.perf_counter()
        starts.append(t0)
        for room, sender in zip(group, senders, strict=True):
            sender.send(src_pages, last=True, metadata=MetadataRecord(room=room, first_token=1))
        while not all(sender.poll().is_final for sender in senders):
            time.sleep(POLL_S)
        times.append(time.perf_counter() - t0)
        for sender in senders:
            if sender.poll() != KVPoll.Success:
                out.put(("failed", sender.failure()))
                return
            sender.clear()
    out.put(("times", times, starts))
    time.sleep(1)
    mgr.close()
    server.stop()


def bench_backend(backend: str, src_pages: list[int], dst_tables: list[list[int]], reps: int, src: KVArgs,
                  geom: Geometry, options: dict[str, str], at_decode: list[float] | None = None) -> list[float]:
    """Seconds per rep: ``len(dst_tables)`` requests in flight at once, one per destination table. ``at_decode``
    gets, per rep, the seconds from the first ``send`` to decode's last ``Success`` (``perf_counter`` is one clock
    for the two processes of one host)."""
    from kvtransfer.decode_rooms import DecodeRooms
    from kvtransfer.manager import KVManager
    from kvtransfer.poll import KVPoll
    from kvtransfer.receiver import KVReceiver

    config = replace(KVTransferConfig(backend=backend, cluster_token="bench"), transfer_timeout_s=120,
                     backend_options=options)
    k = len(dst_tables)
    rooms = [[1000 + i * k + j for j in range(k)] for i in range(reps + 1)]
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_prefill_child, args=(backend, config, src_pages, rooms, out, geom), daemon=True)
    proc.start()
    dst = make_pool(None, geom)
    mgr = KVManager(dst, config, DecodeRooms)
    try:
        kind, port = out.get(timeout=180)
        decoded = []
        for group in rooms:
            receivers = [KVReceiver(mgr, room, f"127.0.0.1:{port}") for room in group]
            for slot, (receiver, dst_pages) in enumerate(zip(receivers, dst_tables, strict=True)):
                receiver.init(0)
                receiver.send_metadata(dst_pages, slot)
            end = time.monotonic() + 180
            while not all(r.poll().is_final for r in receivers) and time.monotonic() < end:
                time.sleep(POLL_S)
            decoded.append(time.perf_counter())
            for room, receiver in zip(group, receivers, strict=True):
                if receiver.poll() != KVPoll.Success:
                    raise RuntimeError(f"{backend}: room {room} {receiver.poll().name}: {receiver.failure()}")
                receiver.clear()
        kind, payload, *starts = out.get(timeout=60)
        if kind != "times":
            raise RuntimeError(f"{backend}: prefill side: {payload}")
        if at_decode is not None:
            at_decode.extend(d - s for d, s in zip(decoded[1:], starts[0][1:], strict=True))
        if backend != "fake":
            for dst_pages in dst_tables:
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


# (baseline key, its name, backend, target ratio) on CPU pools
TARGETS = [("raw_tcp", "raw TCP sendmsg", "tcp", 1.0), ("memcpy", "memcpy 1T", "shm", 0.85),
           ("raw_nixl", "raw NIXL", "nixl", 0.9), ("raw_nixl", "raw NIXL", "ucx", 1.0),
           ("raw_mooncake", "raw Mooncake", "mooncake", 0.9)]


def gbps(times: list[float], geom: Geometry, requests: int = 1) -> float:
    return requests * geom.nbytes / statistics.median(times) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backends", default="", help="default: all but fake then fake (cpu); shm,tcp (cuda)")
    parser.add_argument("--modes", default="", help="default: contiguous,paged (cpu); paged (cuda)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each backend and its baseline this many times, alternating which goes first; "
                             "the target ratio is the median of the rounds' ratios")
    parser.add_argument("--tokens", type=int, default=4096, help="request size (x 128 KiB); small runs: 256")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option, given to the backends that read it: stage=always (tcp's staged path "
                             "on CPU buffers), streams=1 (tcp on one connection)")
    parser.add_argument("--inflight", default="",
                        help="comma-separated counts of requests in flight at once; default 1,4 (cuda), 1 (cpu)")
    parser.add_argument("--json", default="")
    opts = parser.parse_args()
    try:
        inflights = [int(k) for k in (opts.inflight or ("1,4" if opts.device == "cuda" else "1")).split(",")]
    except ValueError:
        parser.error(f"--inflight takes comma-separated positive integers, not {opts.inflight!r}")
    if min(inflights) < 1 or max(inflights) > 16 or len(set(inflights)) != len(inflights):
        parser.error(f"--inflight takes distinct integers from 1 to 16 (the pools' metadata slots), not "
                     f"{opts.inflight!r}")
    options = dict(o.split("=", 1) for o in opts.option)
    if opts.tokens < PAGE * RUN or opts.tokens % (PAGE * RUN):
        parser.error(f"--tokens must be a positive multiple of {PAGE * RUN}")
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    cuda = opts.device == "cuda"
    geom = Geometry(opts.tokens, "cuda:0" if cuda else "cpu", max(inflights))
    backends = (opts.backends or ("shm,tcp" if cuda else ",".join(n for n in KV_TRANSFER_BACKENDS if n != "fake") + ",fake"))
    modes = opts.modes or ("paged" if cuda else "contiguous,paged")
    known = [KV_TRANSFER_BACKENDS[b].options for b in backends.split(",") if b in KV_TRANSFER_BACKENDS]
    unread = [k for k in options if not any(k in opts for opts in known)]
    if unread:
        parser.error(f"--option {unread} is read by none of the backends {backends}")
    torch.set_num_threads(1)
    src = make_pool(SRC_SEED, geom)
    host_src = make_pool(SRC_SEED, geom, "cpu") if cuda else src
    scratch = None if cuda else make_pool(None, geom)
    copy_name, copy_key = ("device copy", "device_copy") if cuda else ("memcpy 1T", "memcpy")
    results: dict[str, dict[str, float | str]] = {}
    for mode, inflight in [(m, k) for m in modes.split(",") for k in inflights]:
        src_pages, dst_tables = page_tables(mode, 11, geom, inflight)
        runs = runs_of(src_pages, dst_tables[0])
        row = results.setdefault(mode if inflight == 1 else f"{mode} x{inflight}", {})
        def baseline(name: str, runs: list[tuple[int, int, int]] = runs) -> float:
            if name == copy_key:
                return gbps(bench_device_copy(geom, opts.reps) if scratch is None else
                            bench_memcpy(src, scratch, runs, opts.reps), geom)
            bench = {"raw_tcp": bench_raw_tcp, "raw_nixl": bench_raw_nixl, "raw_mooncake": bench_raw_mooncake}[name]
            return gbps(bench(host_src if name == "raw_tcp" else src, runs, opts.reps, geom), geom)

        # NOTE: each backend runs next to its own baseline, ``--rounds`` times (on a shared machine the load drifts
        # within minutes), nixl then ucx last: importing ucxx sets UCX_* variables in this process's environment
        # (UCX_MEMTYPE_CACHE=n, UCX_RNDV_THRESH=8192, ...) that NIXL's UCX here and in later children would read
        # (at a fraction of its speed); the environment is restored after every measurement, and ucx's UCX is set up.
        for backend in sorted(backends.split(","), key=lambda name: {"nixl": 1, "ucx": 2}.get(name, 0)):
            base = None if cuda else next((b for b, _, name, _ in TARGETS if name == backend), None)
            measured: dict[str, list[float]] = {backend: []}
            at_decode: list[float] = []  # GB/s per round, timed to decode's Success
            if base is not None:
                measured[base] = []
            for r in range(opts.rounds):
                # ABBA: odd rounds run the backend first, so a drifting load weighs on both sides alike
                for name in (list(measured) if r % 2 else list(measured)[::-1]):
                    env = dict(os.environ)
                    try:
                        decode_s: list[float] = []
                        measured[name].append(baseline(name) if name == base else gbps(
                            bench_backend(backend, src_pages, dst_tables, opts.reps, src, geom,
                                          {k: v for k, v in options.items() if k in KV_TRANSFER_BACKENDS[backend].options},
                                          decode_s),
                            geom, inflight))
                        if decode_s:
                            at_decode.append(gbps(decode_s, geom, inflight))
                    except Exception as exc:  # a backend's failure goes in the table; the other backends go on
                        if name == base:
                            raise
                        measured[name].append(float("nan"))
                        row[name] = f"error: {exc}"
                    finally:  # importing ucxx writes UCX_* variables that NIXL's UCX would read (it slows NIXL)
                        os.environ.clear()
                        os.environ.update(env)
                print(f"{mode:10s} x{inflight} round {r}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in measured.items()),
                      file=sys.stderr, flush=True)
            for name, values in measured.items():
                if not isinstance(row.get(name), str):
                    row[name] = statistics.median(values)
            if at_decode and not isinstance(row.get(backend), str):
                row[f"{backend} at decode"] = statistics.median(at_decode)
            if base is not None and opts.rounds > 1 and not isinstance(row[backend], str):
                ratios = [v / b for v, b in zip(measured[backend], measured[base], strict=True)]
                row[f"{backend}/{base}"] = statistics.median(ratios)
                row[f"{backend}/{base} rounds"] = ", ".join(f"{x:.2f}" for x in ratios)
        for base in (copy_key, "raw_tcp"):  # the table's columns
            if base not in row:
                row[base] = baseline(base)
    mib = geom.nbytes / 2**20
    print(f"\n{mib:.0f} MiB requests on {geom.device} (mode xK: K in flight at once), median of {opts.reps} reps, "
          f"GB/s (ratio to raw TCP sendmsg / to {copy_name})\n")
    print(f"| mode | {copy_name} | raw TCP | " + " | ".join(backends.split(",")) + " |")
    print("|---|---|---|" + "---|" * len(backends.split(",")))
    for mode, row in results.items():
        cells = []
        for backend in backends.split(","):
            v = row[backend]
            cells.append(v if isinstance(v, str) else
                         f"{v:.2f} ({v / float(row['raw_tcp']):.2f}x / {v / float(row[copy_key]):.2f}x)")
        print(f"| {mode} | {row[copy_key]:.2f} | {row['raw_tcp']:.2f} | " + " | ".join(cells) + " |")
    for mode, row in results.items():
        for base, base_name, backend, target in TARGETS:
            if base in row and backend in row:
                v = row[backend]
                paired = row.get(f"{backend}/{base}")
                ratio = v if isinstance(v, str) else f"{float(paired if paired is not None else v / float(row[base])):.2f}x"
                rounds = f" (median of rounds {row[f'{backend}/{base} rounds']})" if paired is not None else ""
                print(f"{mode}: {backend} / {base_name} ({float(row[base]):.2f} GB/s) = {ratio}{rounds} "
                      f"(target >= {target}x)")
        for backend in backends.split(","):
            if f"{backend} at decode" in row:
                v = float(row[f"{backend} at decode"])
                print(f"{mode}: {backend} timed to decode's Success: {v:.2f} GB/s = {v / float(row[copy_key]):.2f}x "
                      f"the {copy_name}")
    if cuda:
        print("\ntargets: shm >= 0.5x the device copy, tcp >= 0.8x raw TCP")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({mode: {**row, "device": geom.device, "tokens": geom.tokens} for mode, row in results.items()},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
