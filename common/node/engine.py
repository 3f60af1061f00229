"""``Engine``: the in-process colocated server. A scheduler thread runs the loop; callers submit requests and
read outputs synchronously (``generate``) or as an async token stream (``generate_stream``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from common.config import ServerArgs
from common.engine.device import bind_rank_cores, cpu_threads_per_rank, rank_device
from common.engine.distributed import TPGroup, broadcast_inputs, host_store, init_tp_group
from common.engine.io_struct import (
    AbortReq,
    GenerateReqInput,
    LoadOut,
    LoadReq,
    QueueLoad,
    ShutdownReq,
    Timing,
    TokenOut,
)
from common.engine.model.config import ModelConfig
from common.engine.sampling.params import SamplingParams
from common.engine.scheduler import Scheduler
from common.errors import CapacityError, ConfigError, ErrorCode, InvalidRequestError, PdclusterError
from common.node.profiler import StepProfiler
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import load_tokenizer, resolve_model_path

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05
TP_TIMEOUT_S = 120.0  # an Engine's TP group: start-up rendezvous and the longest wait in one collective


class RequestFailed(PdclusterError):
    """The request ended as an abort; ``code`` is the gRPC status name (INVALID_ARGUMENT, CANCELLED, ...)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class GenerateOutput:
    rid: str
    prompt_token_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    timing: Timing | None = None
    # Speculative decoding: verify steps with drafts, draft tokens proposed, and of them accepted (0 when off).
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class StreamChunk:
    rid: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    output: GenerateOutput | None = None  # set on the last chunk


class _RequestState:
    def __init__(self, out: GenerateOutput, detok: IncrementalDetokenizer, deliver: Callable[[Any], None]) -> None:
        self.out = out
        self.detok = detok
        self.deliver = deliver


class Engine:
    """With ``tp_size`` > 1 this thread is TP rank 0 and ranks 1..tp-1 run in spawned processes that step in
    lockstep on the inputs it broadcasts (one TP Engine per process: torch.distributed has one default group)."""

    def __init__(self, args: ServerArgs | None = None, **overrides: Any) -> None:
        args = (args or ServerArgs()).replace(**overrides) if overrides else (args or ServerArgs())
        self.args = args
        self.model_path = str(resolve_model_path(args.model_path))
        self.tokenizer = load_tokenizer(self.model_path)
        self.model_config = ModelConfig.from_path(self.model_path, args.load_format)
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._states: dict[str, _RequestState] = {}
        self._lock = threading.Lock()
        self._load_waiters: list[queue.Queue[QueueLoad]] = []
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._followers: list[multiprocessing.process.BaseProcess] = []
        self._store: Any = None
        self.profiler = StepProfiler()  # start/stop a torch profiler window over the scheduler's steps
        # NOTE: torch's thread count is per thread (the scheduler thread sets this one's). The leader's
        # --cpu-omp-threads-bind set pins this thread; the scheduler thread (and its torch threads) inherit it.
        cores = bind_rank_cores(args, 0, args.tp_ranks_here.start)
        if args.torch_num_threads or cores is not None:
            torch.set_num_threads(cpu_threads_per_rank(args, cores))
        self._num_threads = torch.get_num_threads()
        tp = self._start_tp_group() if args.tp_size > 1 else None
        # NOTE: the scheduler is built on the thread that runs it: libgomp keeps a team per thread that opened a
        # parallel region; with more teams than cores idle team threads sleep, and every region waits for a wake-up.
        started: queue.Queue[BaseException | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(tp, started), name="pdcluster-scheduler", daemon=True)
        self._thread.start()
        error: BaseException | None = RuntimeError("the scheduler thread ended before its scheduler was built")
        while self._thread.is_alive() or not started.empty():  # building the scheduler has deadlines
            with contextlib.suppress(queue.Empty):
                error = started.get(timeout=1.0)
                break
        if error is not None:
            self._thread.join(timeout=10)
            if tp is not None:
                tp.destroy()  # so a later Engine in this process can form its group
            self._stop_followers(kill=True)
            raise error

    # -- TP ranks --------------------------------------------------------------------------------------------------
    def _start_tp_group(self) -> TPGroup:
        args = self.args
        if args.nnodes > 1 or args.dp_size > 1:
            raise ConfigError("Engine runs one DP replica on one host; use `pdcluster serve` for --dp-size or --nnodes")
        if dist.is_initialized():
            raise ConfigError("one TP Engine per process: torch.distributed is already initialized here")
        from common.node.scheduler_process import run_scheduler_process

        self._store = host_store("127.0.0.1:0", TP_TIMEOUT_S)
        self.args = args = args.replace(dist_init_addr=f"127.0.0.1:{self._store.port}",
                                        watchdog_timeout=min(args.watchdog_timeout, TP_TIMEOUT_S))
        spawn = multiprocessing.get_context("spawn")
        for tp_rank in range(1, args.tp_size):
            proc = spawn.Process(target=run_scheduler_process, name=f"pdcluster-engine-tp{tp_rank}", daemon=True,
                                 args=(args, self.model_path, 0, None, os.getpid(), tp_rank))
            proc.start()
            self._followers.append(proc)
        try:
            return init_tp_group(dist_init_addr=args.dist_init_addr or "", dp_rank=0, tp_rank=0,
                                 tp_size=args.tp_size, device=rank_device(args, 0, 0), timeout_s=TP_TIMEOUT_S)
        except Exception as e:
            self._stop_followers(kill=True)
            codes = [p.exitcode for p in self._followers]
            raise RuntimeError(f"TP group did not form (follower exit codes {codes}; see their log): {e}") from e

    def _stop_followers(self, kill: bool = False) -> None:
        for proc in self._followers:
            if kill:
                proc.kill()
            proc.join(10)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
        self._store = None

    # -- scheduler thread ------------------------------------------------------------------------------------------
    def _run(self, tp: TPGroup | None, started: queue.Queue[BaseException | None]) -> None:
        torch.set_num_threads(self._num_threads)
        try:
            self.scheduler = Scheduler(self.args, self.model_path, self.tokenizer, self._on_outputs, 0, tp)
        except BaseException as e:  # re-raised by the constructor
            started.put(e)
            return
        started.put(None)
        self._loop()

    def _loop(self) -> None:
        tp = self.scheduler.tp
        try:
            while not self._stop.is_set():
                self.profiler.poll()
                msgs = []
                try:
                    if self.scheduler.is_idle():
                        msgs.append(self._inbox.get(timeout=IDLE_WAIT_S))
                    while True:
                        msgs.append(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                try:
                    self.scheduler.step(broadcast_inputs(tp, msgs))
                except Exception:
                    logger.exception("scheduler step failed; aborting every request in flight")
                    self._fail_all("internal scheduler error; see the server log")
                    raise
            if tp.tp_size > 1:
                broadcast_inputs(tp, [ShutdownReq()])
        finally:
            with contextlib.suppress(Exception):
                self.scheduler.close()
            tp.destroy()

    def _fail_all(self, message: str) -> None:
        with self._lock:
            states = list(self._states.items())
        for rid, state in states:
            state.deliver(TokenOut(rid=rid, token_ids=[], finish_reason="abort", error=message, error_code=ErrorCode.INTERNAL))

    def _on_outputs(self, msgs: list[Any]) -> None:
        for msg in msgs:
            if isinstance(msg, LoadOut):
                with self._lock:
                    waiters, self._load_waiters = self._load_waiters, []
                for w in waiters:
                    w.put(msg.load)
                continue
            with self._lock:
                state = self._states.get(msg.rid)
            if state is not None:
                state.deliver(msg)

    # -- request building ------------------------------------------------------------------------------------------
    def _make_input(
        self,
        prompt: str | None,
        input_ids: list[int] | None,
        sampling_params: SamplingParams | dict[str, Any] | None,
        return_logprob: bool,
        top_logprobs_num: int,
        rid: str | None,
        prior_output_len: int = 0,
        priority: int | None = None,
        stream: bool = True,
    ) -> GenerateReqInput:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("pass exactly one of prompt or input_ids")
        if input_ids is None:
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = msgspec.convert(input_ids, list[int])
            except msgspec.ValidationError as e:
                raise InvalidRequestError(f"input_ids must be a list of token ids (ints): {e}") from None
        sp = sampling_params if isinstance(sampling_params, SamplingParams) else msgspec.convert(
            sampling_params or {}, SamplingParams)
        sp.verify(self.model_config.vocab_size)
        if not ids:
            raise InvalidRequestError("prompt is empty; send at least one token")
        if len(ids) >= self.model_config.context_len:
            raise CapacityError(
                f"prompt has {len(ids)} tokens but the model context is {self.model_config.context_len}; "
                "shorten the prompt"
            )
        if top_logprobs_num < 0:
            raise InvalidRequestError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
        return GenerateReqInput(
            rid=rid or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            input_ids=ids,
            sampling_params=sp,
            return_logprob=return_logprob or top_logprobs_num > 0,
            top_logprobs_num=top_logprobs_num,
            prior_output_len=prior_output_len,
            priority=priority,
            stream=stream,
        )

    def _register(self, msg: GenerateReqInput, deliver: Callable[[Any], None]) -> _RequestState:
        sp = msg.sampling_params
        state = _RequestState(
            GenerateOutput(rid=msg.rid, prompt_token_ids=msg.input_ids),
            IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens, sp.stop),
            deliver,
        )
        with self._lock:
            self._states[msg.rid] = state
        self._inbox.put(msg)
        return state

    def _apply(self, state: _RequestState, msg: TokenOut) -> str:
        out = state.out
        out.output_ids.extend(msg.token_ids)
        out.logprobs.extend(msg.logprobs)
        out.top_logprobs.extend(msg.top_logprobs)
        out.cached_tokens = msg.cached_tokens
        final = msg.finish_reason is not None
        delta = state.detok.add(msg.token_ids, final=final)
        if final:
            out.finish_reason, out.matched_stop, out.timing = msg.finish_reason, msg.matched_stop, msg.timing
            out.spec_verify_ct, out.spec_draft_tokens = msg.spec_verify_ct, msg.spec_draft_tokens
            out.spec_accepted_tokens = msg.spec_accepted_tokens
            out.text = state.detok.text
            with self._lock:
                self._states.pop(msg.rid, None)
            if msg.error_code == ErrorCode.INVALID_ARGUMENT:
                raise InvalidRequestError(msg.error or "invalid request")
            if msg.error_code not in (None, ErrorCode.CANCELLED):
                raise RequestFailed(msg.error or "request failed", msg.error_code)
        return delta

    # -- public API ------------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        timeout: float = 600.0,
        prior_output_len: int = 0,
        priority: int | None = None,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Run one prompt (returns one output) or a batch (returns a list), blocking until all finish.
        ``prior_output_len``: continue a migrated request whose last that many input ids are earlier outputs.
        ``priority``: with --enable-priority-scheduling (see common.engine.schedule_policy)."""
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("pass exactly one of prompt or input_ids")
        batched = isinstance(prompt, list) or (isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list))
        prompts: list[Any] = (prompt if isinstance(prompt, list) else [prompt]) if prompt is not None else []
        ids_list: list[Any] = (input_ids if batched else [input_ids]) if input_ids is not None else []
        # NOTE: stream=False: each request's tokens come in one message, with its end
        msgs = [self._make_input(p, None, sampling_params, return_logprob, top_logprobs_num, None, prior_output_len,
                                 priority, stream=False) for p in prompts]
        msgs += [self._make_input(None, i, sampling_params, return_logprob, top_logprobs_num, None, prior_output_len,
                                  priority, stream=False) for i in ids_list]
        if not msgs:
            raise InvalidRequestError("pass exactly one of prompt or input_ids")
        done: queue.Queue[TokenOut] = queue.Queue()
        states = [self._register(m, done.put) for m in msgs]
        by_rid = {s.out.rid: s for s in states}
        remaining = len(states)
        error: Exception | None = None
        while remaining:
            try:
                msg = done.get(timeout=timeout)
            except queue.Empty:
                for s in states:
                    self.abort(s.out.rid)
                raise TimeoutError(f"generate did not finish within {timeout} s") from None
            try:
                self._apply(by_rid[msg.rid], msg)
            except PdclusterError as e:
                error = error or e
            if msg.finish_reason is not None:
                remaining -= 1
        if error is not None:
            raise error
        outs = [s.out for s in states]
        return outs if batched else outs[0]

    async def generate_stream(
        self,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        rid: str | None = None,
        priority: int | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Yield text deltas as tokens arrive; cancelling the consumer aborts the request."""
        msg = self._make_input(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, rid,
                               priority=priority)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenOut] = asyncio.Queue()
        state = self._register(msg, lambda m: loop.call_soon_threadsafe(q.put_nowait, m))
        finished = False
        try:
            while not finished:
                out = await q.get()
                text = self._apply(state, out)
                finished = out.finish_reason is not None
                yield StreamChunk(out.rid, out.token_ids, text, out.finish_reason, state.out if finished else None)
        finally:
            if not finished:
                self.abort(msg.rid)

    def abort(self, rid: str, reason: str = "aborted by client") -> None:
        self._inbox.put(AbortReq(rid=rid, reason=reason))

    def get_load(self, timeout: float = 10.0) -> QueueLoad:
        waiter: queue.Queue[QueueLoad] = queue.Queue()
        with self._lock:
            self._load_waiters.append(waiter)
        self._inbox.put(LoadReq())
        return waiter.get(timeout=timeout)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._stop_followers()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
