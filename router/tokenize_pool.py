"""``TokenizePool``: a bounded set of tokenize worker processes, so large prompts never tokenize on the event loop.

Processes, not threads: the HF ``tokenizers`` encode holds the GIL (a thread encoding a multi-MB prompt stalls the
event loop's thread: benchmarks/pages/prompt_storm.md), and only a process can be stopped mid-encode.
Workers are forked from a fork server (see ``_CTX``) and talk over a socketpair (router/tokenize_messages.py).

Slots: ``size`` workers, each idle (in ``_idle``), busy (one job), or starting. A job that ends early (client gone,
deadline) kills its worker and starts a replacement, so its slot never stays held by work nobody wants. Workers
start lazily, on the first job, and every wait (a free worker, a worker's start, a job) has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import socket
import sys
import time
from array import array
from multiprocessing.process import BaseProcess
from pathlib import Path

from common import env
from common.errors import InvalidRequestError
from router.errors import DeadlineError, RouterError, UnavailableError
from router.tokenize_messages import HEADER_BYTES, RESULT_DECODER, TokenizeJob, TokenizeResult, frame
from router.tokenize_worker import serve

logger = logging.getLogger(__name__)

# Workers fork from multiprocessing's fork server (never from the router: it runs gRPC threads), started once per
# router process; it imports the worker module, which loads the tokenizer named by env.tokenize_preload, so a
# replacement worker starts with it loaded. NOTE: like every multiprocessing child, each worker imports the main
# module unless it is run as ``python -m pkg`` / ``pkg.__main__`` (keep ``if __name__ == "__main__"`` guards).
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["router.tokenize_worker"])

PIPE_LIMIT = 16 << 20  # asyncio stream buffer; frames are read with readexactly, so larger ones still pass
START_BACKOFF_S = (0.5, 30.0)
JOB_ATTEMPTS = 2
LIST_SLICE = 1 << 16  # token ids turned into Python ints per event-loop turn (a few ms of the loop)


class _Worker:
    def __init__(self, proc: BaseProcess, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.proc = proc
        self.reader = reader
        self.writer = writer

    async def read(self) -> TokenizeResult:
        header = await self.reader.readexactly(HEADER_BYTES)
        return RESULT_DECODER.decode(await self.reader.readexactly(int.from_bytes(header, "big")))

    def alive(self) -> bool:
        return self.proc.is_alive() and not self.reader.at_eof()

    def kill(self) -> None:
        self.writer.close()
        if self.proc.is_alive():
            self.proc.kill()

    async def reap(self, timeout_s: float) -> None:
        await asyncio.to_thread(self.proc.join, timeout_s)


class TokenizePool:
    def __init__(self, model_path: Path, size: int, start_timeout_s: float = 120.0, l1_bytes: int = 0) -> None:
        """``l1_bytes``: each worker's L1 tokenizer cache (router/tokenize_cache.py; 0: none)."""
        self.model_path = model_path
        self.l1_bytes = l1_bytes
        self.size = size
        self.start_timeout_s = start_timeout_s
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._busy: set[_Worker] = set()
        self._started = False
        self._closed = False

    @property
    def started(self) -> bool:
        """False until the first job (workers start lazily)."""
        return self._started

    @property
    def busy(self) -> int:
        """Workers holding a job now."""
        return len(self._busy)

    @property
    def idle(self) -> int:
        return self._idle.qsize()

    def idle_pids(self) -> list[int]:
        return [w.proc.pid for w in self._idle._queue if w.proc.pid is not None]  # type: ignore[attr-defined]

    async def tokenize(self, job: TokenizeJob, deadline: float) -> list[int]:
        """The job's token ids. ``deadline`` is ``time.monotonic()`` time. Raises ``InvalidRequestError`` (the chat
        template refused the messages), ``DeadlineError``, or ``RouterError`` (a worker died mid-job)."""
        result = await self._run(job, deadline)
        if result.invalid:
            raise InvalidRequestError(result.invalid)
        packed = array("I")
        packed.frombytes(result.ids)
        if sys.byteorder != "little":
            packed.byteswap()
        # NOTE: in slices, yielding between them: one tolist() of a multi-MB prompt's ids would hold the loop.
        ids: list[int] = []
        for start in range(0, len(packed), LIST_SLICE):
            ids.extend(packed[start : start + LIST_SLICE].tolist())
            await asyncio.sleep(0)
        return ids

    async def _run(self, job: TokenizeJob, deadline: float) -> TokenizeResult:
        """One job on one worker. A worker found dead in the idle queue is replaced and skipped; a worker that dies
        mid-job is retried once on another (a job is pure, and one bad prompt can then kill at most two)."""
        if self._closed:
            raise UnavailableError("the router is shutting down")
        self._start()
        for attempt in range(JOB_ATTEMPTS):
            worker = await self._take_idle(deadline)
            try:
                return await self._run_on(worker, job, deadline)
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                if attempt + 1 == JOB_ATTEMPTS:
                    raise RouterError("a router tokenizer worker failed", internal=repr(e)) from e
                logger.warning("tokenizer worker died mid-job (%r); retrying the job on another worker", e)
        raise AssertionError("unreachable")

    async def _take_idle(self, deadline: float) -> _Worker:
        """An idle worker that is still alive; dead ones (killed while idle, e.g. by the OOM killer) are replaced."""
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                while True:
                    worker = await self._idle.get()
                    if worker.alive():
                        return worker
                    logger.warning("tokenizer worker (pid %s) died while idle; starting a replacement", worker.proc.pid)
                    worker.kill()
                    self._spawn(reap=worker)
        except TimeoutError:
            raise DeadlineError(
                f"the request's deadline passed while waiting for one of the router's {self.size} tokenizer "
                "workers (all busy with other large prompts)"
            ) from None

    async def _run_on(self, worker: _Worker, job: TokenizeJob, deadline: float) -> TokenizeResult:
        self._busy.add(worker)
        done = False
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                worker.writer.write(frame(job))
                await worker.writer.drain()
                result = await worker.read()
            done = True
            return result
        except TimeoutError:
            raise DeadlineError("the request's deadline passed while its prompt was being tokenized") from None
        finally:
            self._busy.discard(worker)
            if done:
                self._idle.put_nowait(worker)
            else:  # cancelled, timed out or dead: the worker may still be encoding; its slot gets a new worker
                worker.kill()
                self._spawn(reap=worker)

    def _start(self) -> None:
        if not self._started:
            self._started = True
            env.set_tokenize_preload(str(self.model_path))
            for _ in range(self.size):
                self._spawn()

    def _spawn(self, reap: _Worker | None = None) -> None:
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._start_one(reap))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_one(self, reap: _Worker | None) -> None:
        if reap is not None:
            await reap.reap(self.start_timeout_s)
        backoff = START_BACKOFF_S[0]
        while not self._closed:
            try:
                worker = await self._launch()
            except (OSError, RuntimeError, EOFError, TimeoutError, asyncio.IncompleteReadError) as e:
                logger.warning("tokenizer worker did not start (%r); retrying in %.1f s", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, START_BACKOFF_S[1])
                continue
            if self._closed:
                worker.kill()
                return
            self._idle.put_nowait(worker)
            return

    async def _launch(self) -> _Worker:
        """A started worker that has loaded its tokenizer (its ready frame read), or raises."""
        ours, theirs = socket.socketpair()
        proc = _CTX.Process(
            target=serve, args=(theirs, str(self.model_path), self.l1_bytes), name="pdcluster-tokenize", daemon=True
        )
        try:
            # NOTE: in a thread: the first start waits for the fork server to import transformers (seconds).
            await asyncio.wait_for(asyncio.to_thread(proc.start), self.start_timeout_s)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=PIPE_LIMIT)
        worker = _Worker(proc, reader, writer)
        try:
            await asyncio.wait_for(worker.read(), self.start_timeout_s)
        except BaseException:
            worker.kill()
            raise
        return worker

    async def close(self, timeout_s: float = 5.0) -> None:
        """Kill every worker (idle, busy or starting) and reap them."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        workers = [*self._busy]
        while not self._idle.empty():
            workers.append(self._idle.get_nowait())
        for w in workers:
            w.kill()
        pending = [*self._tasks, *(asyncio.ensure_future(w.reap(timeout_s)) for w in workers)]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
