"""The GPU check's dry run starts its steps by ``fork`` from a process that imported their modules once, instead of a
fresh interpreter each: on the CPU test machine a step's own work is smaller than importing torch, transformers and
the project again (the dry run is in ``make test``). Each step still runs as ``python -m <module> <args>`` would
(``runpy`` as ``__main__``, its own session and log), so a deadline ends it and its children the same way.

Never used on a GPU: a process that touched CUDA cannot fork a child that uses it, and the check's timings want
fresh processes. The parent must fork from one thread (``gpu_check`` uses it only with ``--jobs 1``), before any
module that starts threads (``mooncake.engine``, ``ray``) is imported: ``environment`` is read in a child here.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What the dry run's steps import: loaded once in the parent, shared by every forked step.
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "pytest", "aiohttp", "grpc",
           "common.node.engine", "common.engine.model_runner", "kvtransfer.manager", "benchmarks.engine_throughput",
           "benchmarks.gpu_pd", "benchmarks.kv_transfer", "benchmarks.model_scale", "benchmarks.host_step",
           "benchmarks.kvtrace.phases", "benchmarks.spec_decode", "common.model_gen.copy_model")
POLL_S = 0.02


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)


class ForkedProcess:
    """``python -m <argv>`` in a forked child with its own session, stdout and stderr into ``log``: ``wait``,
    ``pid`` and ``returncode`` as ``subprocess.Popen`` has them."""

    def __init__(self, argv: list[str], log: Path, cwd: Path) -> None:
        if argv[0] != "-m":
            raise ValueError(f"a forked step runs a module (-m ...), not {argv}")
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            _run_child(argv[1], argv[2:], log, cwd)

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"-m {self.pid}", timeout or 0.0)
            time.sleep(POLL_S)
        return self.returncode


def _run_child(module: str, args: list[str], log: Path, cwd: Path) -> None:
    code = 1
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(cwd)
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the step's failure goes to its log, as a fresh interpreter's would
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def in_child(fn: Callable[[], Any]) -> Any:
    """``fn()`` (JSON-able result) run in a forked child, so whatever it imports or starts stays out of this process."""
    read, write = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            with os.fdopen(write, "w") as f:
                json.dump(fn(), f)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text)
