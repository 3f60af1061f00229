"""Spawned TP ranks for tests: ``run_ranks(entry, tp_size, *args)`` starts ``tp_size`` processes joined into one
gloo group (``host_store`` + ``init_tp_group`` on a free 127.0.0.1 port), runs ``entry(tp, *args)`` in each and
returns the results in rank order. A rank's exception fails the test with its traceback; every wait has a deadline.

``entry`` must be a module-level function (spawn pickles it by name) and return something picklable without
shared memory (numpy arrays, not torch tensors: a tensor's storage may vanish with a rank that already exited).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

RANK_DEADLINE_S = 120.0  # rank start-up (importing torch) is slow on a loaded 2-core host


class _RankFailure(str):
    """A rank's traceback, sent instead of its result."""


def _rank_main(entry: Callable[..., Any], tp_rank: int, tp_size: int, addr: str, args: tuple[Any, ...],
               out: Any) -> None:
    try:
        from common.engine.distributed import init_tp_group

        torch.set_num_threads(1)
        tp = init_tp_group(dist_init_addr=addr, dp_rank=0, tp_rank=tp_rank, tp_size=tp_size,
                           device=torch.device("cpu"), timeout_s=RANK_DEADLINE_S)
        try:
            out.put((tp_rank, entry(tp, *args)))
        finally:
            tp.destroy()
    except BaseException:  # reported to the parent, which fails the test with it
        out.put((tp_rank, _RankFailure(traceback.format_exc())))


def run_ranks(entry: Callable[..., Any], tp_size: int, *args: Any, deadline_s: float = RANK_DEADLINE_S) -> list[Any]:
    """``entry(tp, *args)`` on each of ``tp_size`` spawned ranks; their results in rank order."""
    from common.engine.distributed import host_store

    store = host_store("127.0.0.1:0", deadline_s)  # the store picks its port: no race for a "free" one
    addr = f"127.0.0.1:{store.port}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(entry, r, tp_size, addr, args, out), daemon=True)
             for r in range(tp_size)]
    try:
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        for _ in procs:
            try:
                rank, result = out.get(timeout=deadline_s)
            except queue.Empty:
                pytest.fail(f"TP ranks missed the {deadline_s:.0f} s deadline; reported: {sorted(results)}, exit "
                            f"codes {[p.exitcode for p in procs]}")
            if isinstance(result, _RankFailure):
                pytest.fail(f"TP rank {rank} failed:\n{result}")
            results[rank] = result
        for p in procs:
            p.join(deadline_s)
            assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
        return [results[r] for r in range(tp_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        del store
