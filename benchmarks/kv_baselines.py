"""The baselines ``benchmarks/kv_transfer.py`` measures each backend against, fixed here so a change to a backend's
loops never moves its baseline: ``ctypes.memmove`` in one thread, an in-process device copy, a raw TCP socket
between two processes, and raw NIXL and raw Mooncake (two agents or engines in two processes)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import socket
import time
from typing import Any

import torch

from benchmarks.kv_workload import Geometry, make_pool
from kvtransfer.args import KVArgs


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


def bench_device_copy(geom: Geometry, reps: int) -> list[float]:
    """In-process device-to-device copy of the request's bytes (one contiguous copy, synchronized)."""
    src = torch.empty(geom.nbytes, dtype=torch.uint8, device=geom.device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
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


def _raw_recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """The raw baseline's receive: ``recvmsg_into`` of up to 64 views per call, no flags (what the tcp backend did
    before it asked for MSG_WAITALL), each call returning what has landed."""
    i, off = 0, 0
    while i < len(views):
        batch = views[i:i + 64]
        if off:
            batch[0] = batch[0][off:]
        got = sock.recvmsg_into(batch)[0]
        if got == 0:
            raise ConnectionError("connection closed by peer")
        while got and i < len(views):
            rest = len(views[i]) - off
            if got >= rest:
                got, i, off = got - rest, i + 1, 0
            else:
                off, got = off + got, 0


def _raw_send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """The raw baseline's send: ``sendmsg`` of up to 64 views per call (a blocking socket queues them all)."""
    i, off = 0, 0
    while i < len(views):
        batch = views[i:i + 64]
        if off:
            batch[0] = batch[0][off:]
        sent = sock.sendmsg(batch)
        while sent and i < len(views):
            rest = len(views[i]) - off
            if sent >= rest:
                sent, i, off = sent - rest, i + 1, 0
            else:
                off, sent = off + sent, 0


def _raw_receiver(port_q: mp.Queue, runs: list[tuple[int, int, int]], reps: int, geom: Geometry) -> None:
    dst = make_pool(None, geom, "cpu")
    views = _views(dst, [(d, n) for _, d, n in runs])
    server = socket.create_server(("127.0.0.1", 0))
    port_q.put(server.getsockname()[1])
    conn, _ = server.accept()
    for _ in range(reps + 1):
        _raw_recv_views(conn, views)
        conn.sendall(b"k")
    conn.close()


def bench_raw_tcp(src: KVArgs, runs: list[tuple[int, int, int]], reps: int, geom: Geometry) -> list[float]:
    """Host memory to host memory over loopback (``src`` must be a CPU pool)."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_raw_receiver, args=(q, runs, reps, geom), daemon=True)
    proc.start()
    sock = socket.create_connection(("127.0.0.1", q.get(timeout=120)))
    views = _views(src, [(s, n) for s, _, n in runs])
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        _raw_send_views(sock, views)
        sock.recv(1)
        times.append(time.perf_counter() - t0)
    sock.close()
    proc.join(30)
    return times[1:]


# ---- raw NIXL baseline ---------------------------------------------------------------------------------------------
def _kv_list(args: KVArgs) -> list[torch.Tensor]:
    return [buf for pair in zip(args.k_buffers, args.v_buffers, strict=True) for buf in pair]


def _nixl_agent(name: str) -> Any:  # nixl is imported only when the nixl baseline runs
    from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))


def _raw_nixl_target(out: mp.Queue, done: mp.Queue, geom: Geometry) -> None:
    bufs = _kv_list(make_pool(None, geom, "cpu"))
    agent = _nixl_agent("bench-raw-target")
    reg = agent.register_memory(bufs, backends=["UCX"])
    out.put((agent.get_agent_metadata(), [b.data_ptr() for b in bufs]))
    done.get(timeout=600)
    agent.deregister_memory(reg)


def bench_raw_nixl(src: KVArgs, runs: list[tuple[int, int, int]], reps: int, geom: Geometry) -> list[float]:
    """Agent-to-agent WRITE of the same page runs with NIXL's own API (CPU pools, two processes)."""
    import numpy as np
    bufs = _kv_list(src)
    agent = _nixl_agent("bench-raw-initiator")
    reg = agent.register_memory(bufs, backends=["UCX"])
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_raw_nixl_target, args=(out, done, geom), daemon=True)
    proc.start()
    try:
        metadata, dst_bases = out.get(timeout=120)
        peer = agent.add_remote_agent(metadata)
        item = src.item_len
        local = np.array([(b.data_ptr() + s * item, n * item, 0) for b in bufs for s, _, n in runs], dtype=np.uint64)
        remote = np.array([(b + d * item, n * item, 0) for b in dst_bases for _, d, n in runs], dtype=np.uint64)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), peer)
            state = agent.transfer(handle)
            end = time.monotonic() + 120
            while state == "PROC" and time.monotonic() < end:
                state = agent.check_xfer_state(handle)
            times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL WRITE ended in state {state}")
        agent.remove_remote_agent(peer)
        return times[1:]
    finally:
        done.put("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        agent.deregister_memory(reg)


# ---- raw Mooncake baseline -----------------------------------------------------------------------------------------
def _mooncake_engine(geom: Geometry) -> tuple[Any, KVArgs, list[int]]:
    """A Mooncake engine (P2P handshake, TCP protocol) with a zeroed CPU pool registered, and the buffers' bases."""
    import os
    os.environ.setdefault("GLOG_minloglevel", "1")
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("raw Mooncake: the transfer engine did not start")
    pool = make_pool(None, geom, "cpu")
    bufs = _kv_list(pool)
    bases = [b.data_ptr() for b in bufs]
    if engine.batch_register_memory(bases, [b.numel() * b.element_size() for b in bufs]) != 0:
        raise RuntimeError("raw Mooncake: registering the pool failed")
    return engine, pool, bases


def _raw_mooncake_target(out: mp.Queue, done: mp.Queue, geom: Geometry) -> None:
    engine, _pool, bases = _mooncake_engine(geom)
    out.put((f"127.0.0.1:{engine.get_rpc_port()}", bases))
    done.get(timeout=600)
    engine.batch_unregister_memory(bases)


def bench_raw_mooncake(src: KVArgs, runs: list[tuple[int, int, int]], reps: int, geom: Geometry) -> list[float]:
    """``batch_transfer_sync_write`` of the same page runs (every layer, K and V) with Mooncake's own API, between
    two processes; ``src``'s bytes are copied into a pool registered with the initiator's engine."""
    from kvtransfer.backends.mooncake import MAX_BATCH
    engine, pool, bases = _mooncake_engine(geom)
    for s_buf, d_buf in zip(_kv_list(src), _kv_list(pool), strict=True):
        d_buf.copy_(s_buf)
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_raw_mooncake_target, args=(out, done, geom), daemon=True)
    proc.start()
    try:
        session, dst_bases = out.get(timeout=120)
        item = src.item_len
        local = [b + s * item for b in bases for s, _, n in runs]
        remote = [b + d * item for b in dst_bases for _, d, n in runs]
        lengths = [n * item for _ in bases for _, _, n in runs]
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for i in range(0, len(local), MAX_BATCH):  # the engine refuses larger batches
                ret = engine.batch_transfer_sync_write(session, local[i:i + MAX_BATCH], remote[i:i + MAX_BATCH],
                                                       lengths[i:i + MAX_BATCH])
                if ret != 0:
                    break
            times.append(time.perf_counter() - t0)
            if ret != 0:
                raise RuntimeError(f"raw Mooncake WRITE failed ({ret})")
        return times[1:]
    finally:
        done.put("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        engine.batch_unregister_memory(bases)
