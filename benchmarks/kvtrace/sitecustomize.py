"""Latency trace of the KV control path, for a benchmark run (not part of the product).

    KVTRACE_DIR=/tmp/kvt PYTHONPATH=benchmarks/kvtrace:$PYTHONPATH python -m benchmarks.kv_transfer --backends shm ...

Python imports this ``sitecustomize`` in every process of the run (the spawned prefill child included). It wraps, as
their modules load, ``KVSender.send``, the prefill rooms' ``job_done``/``handle``/``job_enqueued`` (a signalled
job's ChunkDone, before its landing), decode's ``LandingWatch.chunk`` (a ChunkDone arrived) and ``_chunk_done``,
the control plane's ``_do`` (a send) and ``_receive_all``, every backend's ``_move`` (for ``shm`` on CUDA also its
``page_ids`` and the copy's launch, ``PageCopier.__call__``, as ``copy_pages``), the workers' ``_report`` (a
landing's wait, then the report) and the manager's ``on_job_done``, and writes ``<wall time> <pid> <thread> <event>
>|<`` lines to ``$KVTRACE_DIR/t.<pid>``. ``phases.py`` here reads them back as a per-request table; or ``sort`` the
files together to read a request's path across both processes. Inactive without ``KVTRACE_DIR``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from types import ModuleType
from typing import Any

TARGETS = {"kvtransfer.sender", "kvtransfer.prefill_rooms", "kvtransfer.decode_rooms", "kvtransfer.control",
           "kvtransfer.manager", "kvtransfer.backends.workers", "kvtransfer.backends.shm", "kvtransfer.backends.shm_cuda",
           "kvtransfer.backends.tcp", "common.engine.kernels.kv_pages_triton", "kvtransfer.landing"}


def _stamp(out: Any, event: str) -> None:
    out.write(f"{time.time():.6f} {os.getpid()} {threading.current_thread().name} {event}\n")


def _wrap(out: Any, owner: type | ModuleType, name: str, event: str) -> None:
    """Stamp ``event >`` and ``event <`` around ``owner.name``: a class's method, or a module-level function its
    callers look up at call time (``_move`` calls ``page_ids`` so)."""
    orig = getattr(owner, name)

    @functools.wraps(orig)
    def traced(*args: Any, **kwargs: Any) -> Any:
        _stamp(out, f"{event} >")
        try:
            return orig(*args, **kwargs)
        finally:
            _stamp(out, f"{event} <")

    setattr(owner, name, traced)


def _patch(out: Any, name: str, mod: ModuleType) -> None:
    if name == "kvtransfer.manager":
        _wrap(out, mod.KVManager, "on_job_done", "on_job_done")
    elif name == "common.engine.kernels.kv_pages_triton":
        _wrap(out, mod.PageCopier, "__call__", "copy_pages")  # the shm copy's launch on CUDA
    elif name == "kvtransfer.backends.workers":
        _wrap(out, mod.PeerWorkers, "_report", "workers._report")  # the landing's wait, then on_job_done
    elif name == "kvtransfer.sender":
        _wrap(out, mod.KVSender, "send", "KVSender.send")
    elif name == "kvtransfer.prefill_rooms":
        _wrap(out, mod.PrefillRooms, "job_done", "job_done")
        _wrap(out, mod.PrefillRooms, "handle", "prefill.handle")
        _wrap(out, mod.PrefillRooms, "job_enqueued", "job_enqueued")  # a signalled job's ChunkDone leaves
    elif name == "kvtransfer.landing":
        _wrap(out, mod.LandingWatch, "chunk", "landing.chunk")  # a ChunkDone reached decode (maybe before landing)
    elif name == "kvtransfer.decode_rooms":
        _wrap(out, mod.DecodeRooms, "_chunk_done", "decode._chunk_done")
    elif name == "kvtransfer.control":
        _wrap(out, mod.ControlPlane, "_do", "control._do")
        _wrap(out, mod.ControlPlane, "_receive_all", "control._receive_all")
    else:
        if name == "kvtransfer.backends.shm_cuda":
            _wrap(out, mod, "page_ids", "page_ids")
        for attr in dir(mod):
            cls = getattr(mod, attr)
            if isinstance(cls, type) and "_move" in cls.__dict__:
                _wrap(out, cls, "_move", f"{attr}._move")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, out: Any) -> None:
        self.out = out

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        loader, out = spec.loader, self.out
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _patch(out, name, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("KVTRACE_DIR"):
    os.makedirs(os.environ["KVTRACE_DIR"], exist_ok=True)
    _out = open(os.path.join(os.environ["KVTRACE_DIR"], f"t.{os.getpid()}"), "a", buffering=1)  # noqa: SIM115
    sys.meta_path.insert(0, _PatchOnImport(_out))
