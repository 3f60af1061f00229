"""Entry point of one scheduler rank process: build the role's scheduler, then run its loop over ZMQ IPC.

The role object (``Scheduler`` for colocated mode, the prefill/decode node schedulers otherwise) is named by a
``module:Class`` string so this module imports no role package. It must offer ``step(msgs) -> bool``,
``is_idle() -> bool`` and ``close()``; it is built as ``Cls(args, model_path, tokenizer, send_outputs, dp_rank)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import signal
import time
from typing import Any

import torch
import zmq

from common.config import ServerArgs
from common.device import bind_rank_device
from common.io_struct import RankHeartbeat, RankReady, ShutdownReq
from common.server.ipc import IpcAddrs, decode_input, encode
from common.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
IDLE_WAIT_MS = 20
HEARTBEAT_INTERVAL_S = 0.5  # at most one RankHeartbeat per interval; one follows every step or idle poll
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the front dies, so no rank outlives its node."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _load_class(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def run_scheduler_process(
    args: ServerArgs, model_path: str, dp_rank: int, addrs: IpcAddrs, scheduler_ref: str, parent_pid: int
) -> None:
    _die_with_parent()
    logging.basicConfig(
        level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s [DP{dp_rank}] %(name)s: %(message)s"
    )
    torch.set_num_threads(args.torch_num_threads or max(1, (os.cpu_count() or 1) // args.dp_size))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(addrs.rank_in(dp_rank))
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(addrs.out)

    def send_outputs(msgs: list[Any]) -> None:
        push.send(encode(msgs))

    try:
        bind_rank_device(args, dp_rank)
        tokenizer = load_tokenizer(model_path)
        scheduler = _load_class(scheduler_ref)(args, model_path, tokenizer, send_outputs, dp_rank)
    except Exception as e:
        logger.exception("scheduler rank %d failed to start", dp_rank)
        send_outputs([RankReady(dp_rank=dp_rank, error=f"{type(e).__name__}: {e}")])
        raise SystemExit(1) from e
    send_outputs([RankReady(dp_rank=dp_rank, max_total_tokens=scheduler.max_total_num_tokens)])
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    last_parent_check = last_beat = time.monotonic()
    steps = 0
    try:
        while True:
            timeout = IDLE_WAIT_MS if scheduler.is_idle() else 0
            msgs = []
            if poller.poll(timeout):
                while True:
                    try:
                        msgs.append(decode_input(pull.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
            if any(isinstance(m, ShutdownReq) for m in msgs):
                break
            scheduler.step(msgs)
            steps += 1
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_INTERVAL_S:
                last_beat = now
                send_outputs([RankHeartbeat(dp_rank=dp_rank, steps=steps)])
            if now - last_parent_check > 1.0:
                last_parent_check = time.monotonic()
                if os.getppid() != parent_pid:
                    logger.warning("front process is gone; scheduler rank %d exits", dp_rank)
                    break
    finally:
        scheduler.close()
        pull.close(0)
        push.close()
        ctx.term()
