"""``GrammarCompilePool``: one scheduler rank's grammar compiles, in worker processes, each bounded by a deadline.

    submit ──> queued ──> dispatcher thread: the next idle worker (started on demand, up to ``workers``)
                 │          ──> compiled: the worker's converted grammar is compiled here again (it finished there);
                 │              the future's result is a ``Compiled``
                 │          ──> not a valid grammar: the future fails with ``InvalidRequestError``
                 │          ──> still compiling ``timeout_s`` after it was handed over: the worker is SIGKILLed (its memory
                 │              goes with it) and the future fails with ``GrammarCompileAborted``; so does a
                 │              compile whose worker died
                 └─> still queued at its ``expires`` (no request waits for it any more): cancelled

Workers are forked by multiprocessing's forkserver with ``grammar_worker`` preloaded: xgrammar (and the torch it
imports) is imported once per rank, and a worker killed at a deadline is replaced in milliseconds. A compile never
runs in the scheduler process, so its transient memory never stays in the rank's heap.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from common.errors import InvalidRequestError

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

WORKER_MODULE = "common.engine.sampling.grammar_worker"
_CTX = multiprocessing.get_context("forkserver")
_JOIN_S = 5.0  # a killed worker is reaped within this
WORKER_START_S = 120.0  # a worker not ready by then is given up (a cold forkserver imports torch first)


class GrammarCompileAborted(InvalidRequestError):
    """The compile was stopped at its deadline, or its worker died. Unlike a grammar that does not compile, this is
    not decided by the grammar alone, so TP ranks agree on it before they act (``GrammarQueue.pop_ready``)."""


@dataclass(frozen=True)
class Compiled:
    grammar: xgrammar.CompiledGrammar
    nbytes: int  # xgrammar's estimate of its size: what the cache's memory budget counts


@dataclass
class _Job:
    kind: str
    source: str
    any_whitespace: bool
    future: Future[Compiled]
    expires: float  # dropped if still queued then
    started: float = 0.0


@dataclass
class _Worker:
    proc: Any  # multiprocessing.Process
    conn: Connection
    born: float
    ready: bool = False  # it said so once started: its jobs' deadlines run from then
    job: _Job | None = None


def _preload_worker_module() -> None:
    """Add the worker module to the forkserver's preload list (kept: other users' modules), before it starts."""
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    current = list(getattr(server, "_preload_modules", None) or [])
    if WORKER_MODULE not in current:
        _CTX.set_forkserver_preload([*current, WORKER_MODULE])


class GrammarCompilePool:
    def __init__(self, info: xgrammar.TokenizerInfo, workers: int, timeout_s: float) -> None:
        self.info = info
        self.workers = workers
        self.timeout_s = timeout_s
        self._info_json = info.serialize_json()
        self._compiler: Any = None  # the rank's own compiler of the workers' grammars, built on the pool's thread
        self._queue: deque[_Job] = deque()
        self._pool: list[_Worker] = []  # changed by the dispatcher thread only, under the lock
        self._lock = threading.Lock()
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        _preload_worker_module()
        self._thread = threading.Thread(target=self._run, name="pdcluster-grammar-pool", daemon=True)
        self._thread.start()

    def submit(self, kind: str, source: str, any_whitespace: bool, expires: float | None = None) -> Future[Compiled]:
        """Queue one compile; it is dropped (cancelled) if it has not started by ``expires`` (default: ``timeout_s``
        from now; see ``keep``)."""
        job = _Job(kind, source, any_whitespace, Future(), expires or time.monotonic() + self.timeout_s)
        with self._lock:
            if self._closed:
                job.future.set_exception(GrammarCompileAborted(f"{kind} compiles are unavailable on this node"))
                return job.future
            self._queue.append(job)
        self._wake()
        return job.future

    def keep(self, future: Future[Compiled]) -> None:
        """Another request waits for ``future``: a queued compile stays queued ``timeout_s`` from now."""
        with self._lock:
            for job in self._queue:
                if job.future is future:
                    job.expires = max(job.expires, time.monotonic() + self.timeout_s)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._pool]

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(timeout=_JOIN_S)
        if not self._thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the dispatcher
            os.write(self._wake_w, b"\0")

    # -- the dispatcher thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed:
                self._expire_queued()
                self._dispatch()
                self._stop_overdue()
                self._await_replies()
        except Exception:  # a broken pool fails its jobs instead of leaving them waiting
            logger.exception("grammar compile pool failed; grammar requests fail on this rank from now on")
        finally:
            self._shutdown()

    def _expire_queued(self) -> None:
        now = time.monotonic()
        with self._lock:
            dropped = [j for j in self._queue if j.expires <= now or j.future.cancelled()]
            if dropped:
                self._queue = deque(j for j in self._queue if j.expires > now and not j.future.cancelled())
        for job in dropped:
            job.future.cancel()

    def _dispatch(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                worker = next((w for w in self._pool if w.job is None), None)
                if worker is None and len(self._pool) >= self.workers:
                    return
                job = self._queue.popleft()
            if not job.future.running() and not job.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            if worker is None:
                try:
                    worker = self._start_worker()
                except Exception as e:  # any failure to start one fails this job, not the pool
                    logger.error("cannot start a grammar compile process: %s", e)
                    job.future.set_exception(GrammarCompileAborted(
                        f"the {job.kind} could not be compiled: this node cannot start a compile process"))
                    continue
            worker.job = job  # from here the worker's loss fails the job
            if worker.ready:
                self._send(worker)

    def _send(self, worker: _Worker) -> None:
        """Hand the worker its job; the job's deadline runs from now."""
        job = worker.job
        assert job is not None
        job.started = time.monotonic()
        try:
            worker.conn.send((job.kind, job.source, job.any_whitespace))
        except (OSError, ValueError):  # it died idle: the job goes to the next worker
            worker.job = None
            self._lose(worker, "")
            with self._lock:
                self._queue.appendleft(job)

    def _start_worker(self) -> _Worker:
        from common.engine.sampling.grammar_worker import run_worker

        parent, child = _CTX.Pipe()
        proc = _CTX.Process(target=run_worker, args=(child, self._info_json), name="pdcluster-grammar-worker",
                            daemon=True)
        config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
        # NOTE: a scheduler rank is a daemonic process, which multiprocessing forbids to start children (it could
        # not clean them up). Ours clean up after themselves: a worker dies with its forkserver (PDEATHSIG), which
        # exits with this process, and ``close`` kills them.
        daemonic = config.pop("daemon", None)
        try:
            proc.start()
        finally:
            if daemonic is not None:
                config["daemon"] = daemonic
        child.close()
        worker = _Worker(proc, parent, time.monotonic())
        with self._lock:
            self._pool.append(worker)
        return worker

    def _stop_overdue(self) -> None:
        now = time.monotonic()
        for w in list(self._pool):
            if not w.ready and now - w.born >= WORKER_START_S:
                self._lose(w, "this node could not start a grammar compile process in time; retry later")
            elif w.job is not None and w.ready and now - w.job.started >= self.timeout_s:
                self._lose(w, f"the {w.job.kind} did not compile within {self.timeout_s:g} s "
                              "(--grammar-compile-timeout) and its compile was stopped; simplify it")

    def _await_replies(self) -> None:
        now = time.monotonic()
        until = [w.job.started + self.timeout_s if w.ready else w.born + WORKER_START_S
                 for w in self._pool if w.job is not None]
        with self._lock:
            if self._queue:
                until.append(min(j.expires for j in self._queue))
        timeout = max(0.0, min(until) - now) if until else None
        ready = wait([self._wake_r, *(w.conn for w in self._pool)], timeout=timeout)
        for ready_one in ready:
            if ready_one == self._wake_r:
                os.read(self._wake_r, 4096)
                continue
            worker = next(w for w in self._pool if w.conn is ready_one)
            self._reply(worker)

    def _reply(self, worker: _Worker) -> None:
        import xgrammar as xgr

        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        job = worker.job
        try:
            status, payload, exiting = worker.conn.recv()
        except (EOFError, OSError):
            self._lose(worker, "" if job is None else
                       f"the process compiling the {job.kind} died (out of memory?); simplify it")
            return
        if status == "ready":
            worker.ready = True
            if job is not None:
                self._send(worker)
            return
        worker.job = None
        if exiting:  # it recycles itself after a compile that grew its heap
            self._lose(worker, "")
        if job is None:
            return
        if status != "ok":
            job.future.set_exception(InvalidRequestError(payload))
            return
        try:
            compiled = self._compiler.compile_grammar(xgr.Grammar.deserialize_json(payload))
        except (RuntimeError, ValueError, MemoryError) as e:
            job.future.set_exception(GrammarCompileAborted(f"the {job.kind} compiled in its worker but not in the "
                                                           f"scheduler ({type(e).__name__}: {str(e)[:100]})"))
            return
        job.future.set_result(Compiled(compiled, compiled.memory_size_bytes))

    def _lose(self, worker: _Worker, message: str) -> None:
        """Kill ``worker`` and reap it; its compile, if any, fails with ``message``."""
        worker.proc.kill()
        worker.proc.join(timeout=_JOIN_S)
        worker.conn.close()
        with self._lock:
            self._pool.remove(worker)
        if worker.job is not None and not worker.job.future.done():
            worker.job.future.set_exception(GrammarCompileAborted(message))
        worker.job = None

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
        for job in queued:
            if not job.future.cancel() and not job.future.done():
                job.future.set_exception(GrammarCompileAborted(f"the {job.kind} compile pool stopped"))
        for w in list(self._pool):
            self._lose(w, "the node is shutting down")
