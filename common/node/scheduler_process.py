"""Entry point of one scheduler rank process: build the ``Scheduler`` with its mode's role (``common.node.roles``),
then run its loop over ZMQ IPC.

TP (``--tp-size`` > 1): only TP rank 0 (the leader) reads the front's inputs; every step it broadcasts them to its
group, so all ranks step in lockstep on the same messages (an idle leader broadcasts an empty list every
``IDLE_WAIT_MS``). Only the leader's scheduler outputs reach the front; every rank reports ready and heartbeats.
A rank whose peer died fails in its next collective and exits, so no rank of a broken group serves alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from typing import Any

import torch
import zmq

from common.config import ServerArgs
from common.engine.device import bind_rank_cores, bind_rank_device, cpu_threads_per_rank
from common.engine.distributed import TPGroup, broadcast_inputs, init_tp_group
from common.engine.io_struct import RankHeartbeat, RankReady, SchedulerInput, ShutdownReq
from common.engine.scheduler import Scheduler
from common.gc_freeze import freeze_startup_heap
from common.node.ipc import IpcAddrs, decode_input, encode
from common.node.roles import make_role
from common.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
IDLE_WAIT_MS = 20
# Not idle, but the last step ran no batch: the rank only waits on other threads (KV transfers, bootstrap, a peer's
# pages). Nap this long for input instead of spinning a core: on a small host the spin starves the transfer threads
# and the other nodes it waits for. A step that ran a batch polls without waiting.
WAITING_NAP_MS = 1
HEARTBEAT_INTERVAL_S = 0.5  # at most one RankHeartbeat per interval; one follows every step or idle poll
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the front dies, so no rank outlives its node."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_scheduler_process(
    args: ServerArgs, model_path: str, dp_rank: int, addrs: IpcAddrs | None, parent_pid: int, tp_rank: int = 0,
) -> None:
    """Run one rank until ShutdownReq. ``addrs`` None: a TP follower of an in-process ``Engine`` leader, which
    reports nothing (the engine watches its exit code)."""
    _die_with_parent()
    tag = f"DP{dp_rank}" + (f" TP{tp_rank}" if args.tp_size > 1 else "")
    # TP followers repeat the leader's decisions: their batch and request lines would only duplicate its log.
    level = args.log_level.upper() if tp_rank == 0 or args.log_level.lower() == "debug" else "WARNING"
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s")
    torch.set_num_threads(cpu_threads_per_rank(args, bind_rank_cores(args, dp_rank, tp_rank)))
    leader = tp_rank == 0
    ctx = zmq.Context()
    pull = push = None
    if addrs is not None:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(addrs.out)
        if leader:
            pull = ctx.socket(zmq.PULL)
            pull.bind(addrs.rank_in(dp_rank))

    def send_outputs(msgs: list[Any]) -> None:
        if push is not None:
            push.send(encode(msgs))

    def drop_outputs(msgs: list[Any]) -> None:
        """A follower's scheduler makes the leader's decisions; only the leader's outputs reach the front."""

    scheduler: Any = None
    tp = TPGroup(dp_rank=dp_rank)
    try:
        device = bind_rank_device(args, dp_rank, tp_rank)
        if args.tp_size > 1:
            assert args.dist_init_addr is not None, "the front sets --dist-init-addr for tp_size > 1"
            tp = init_tp_group(dist_init_addr=args.dist_init_addr, dp_rank=dp_rank, tp_rank=tp_rank,
                               tp_size=args.tp_size, device=device, timeout_s=args.tp_timeout_s)
        tokenizer = load_tokenizer(model_path)
        scheduler = Scheduler(args, model_path, tokenizer, send_outputs if leader else drop_outputs, dp_rank, tp,
                              role=make_role(args))
    except Exception as e:
        logger.exception("scheduler rank dp=%d tp=%d failed to start", dp_rank, tp_rank)
        send_outputs([RankReady(dp_rank=dp_rank, tp_rank=tp_rank, error=f"{type(e).__name__}: {e}")])
        raise SystemExit(1) from e
    freeze_startup_heap()  # the model and its imports: a full collection here would stall a step for 0.1 s
    send_outputs([RankReady(dp_rank=dp_rank, tp_rank=tp_rank, max_total_tokens=scheduler.max_total_num_tokens)])
    poller = zmq.Poller()
    if pull is not None:
        poller.register(pull, zmq.POLLIN)
    last_parent_check = last_beat = time.monotonic()
    steps = 0
    ran = True
    try:
        while True:
            msgs: list[SchedulerInput] = []
            wait_ms = IDLE_WAIT_MS if scheduler.is_idle() else (0 if ran else WAITING_NAP_MS)
            if pull is not None and poller.poll(wait_ms):
                while True:
                    try:
                        msgs.append(decode_input(pull.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
            msgs = broadcast_inputs(tp, msgs)
            if any(isinstance(m, ShutdownReq) for m in msgs):
                break
            ran = scheduler.step(msgs)
            steps += 1
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_INTERVAL_S:
                last_beat = now
                send_outputs([RankHeartbeat(dp_rank=dp_rank, tp_rank=tp_rank, steps=steps)])
            if now - last_parent_check > 1.0:
                last_parent_check = time.monotonic()
                if os.getppid() != parent_pid:
                    logger.warning("front process is gone; scheduler rank dp=%d tp=%d exits", dp_rank, tp_rank)
                    break
    finally:
        scheduler.close()
        tp.destroy()
        if pull is not None:
            pull.close(0)
        if push is not None:
            push.close()
        ctx.term()
