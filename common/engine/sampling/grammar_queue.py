"""``GrammarQueue``: requests that carry a grammar wait here, ahead of their role's first queue, until it compiles.

    front msg (json_schema / regex / ebnf) ──> GrammarQueue.add: the compile is queued for the rank's worker pool
    each step, before the role's poll: pop_ready ──> compiled everywhere: role.admit (then as any request)
                                                 └─> not a valid grammar: INVALID_ARGUMENT naming the problem
                                                 └─> its compile ran past --grammar-compile-timeout and was
                                                     stopped: INVALID_ARGUMENT naming the limit
                                                 └─> no worker took it by its deadline: DEADLINE_EXCEEDED

The step never waits for a compilation. With TP, "settled" and "failed" are agreed over the group (a MIN and a MAX
of the ranks' rank-local answers) so that every rank admits or fails the same requests at the same step: a compile
stopped at its deadline on one rank fails the request on all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.engine.sampling.grammar_pool import WORKER_START_S, GrammarCompileAborted
from common.errors import ErrorCode

if TYPE_CHECKING:
    from concurrent.futures import Future

    from common.engine.distributed import TPGroup
    from common.engine.io_struct import GenerateReqInput
    from common.engine.sampling.grammar import GrammarCompiler


@dataclass
class _Waiting:
    msg: GenerateReqInput
    compiled: Future
    deadline: float


class GrammarQueue:
    def __init__(self, compiler: Callable[[], GrammarCompiler], tp: TPGroup, timeout_s: float,
                 enabled: bool = True) -> None:
        self.compiler = compiler  # built on first use
        self.enabled = enabled  # False: this node serves no grammars (``--grammar-backend none``)
        self.tp = tp
        self.timeout_s = timeout_s
        self.queue: list[_Waiting] = []

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, msg: GenerateReqInput) -> str | None:
        """Start compiling ``msg``'s grammar and hold it; returns why it is refused instead, or None."""
        key = msg.sampling_params.grammar_key
        assert key is not None
        if not self.enabled:
            return f"{key[0]} needs a grammar backend; this node runs with --grammar-backend none"
        if any(w.msg.rid == msg.rid for w in self.queue):
            return f"request id {msg.rid!r} is already in flight"
        self.queue.append(_Waiting(msg, self.compiler().submit(key), time.monotonic() + self.timeout_s))
        return None

    def remove(self, rid: str) -> bool:
        n = len(self.queue)
        self.queue = [w for w in self.queue if w.msg.rid != rid]
        return len(self.queue) != n

    def pop_ready(self, fail: Callable[[str, str, ErrorCode], None]) -> list[GenerateReqInput]:
        """The messages whose grammar is settled on every rank (compiled, or refused for good: admit them, and
        ``build_req`` refuses the latter); the ones that failed on any rank (compile stopped at its deadline, or
        waited past its deadline for a worker) are failed through ``fail(rid, message, code)``."""
        if not self.queue:
            return []
        now = time.monotonic()
        settled = [int(_settled(w.compiled)) for w in self.queue]
        failed = [int(self._failed(w, now)) for w in self.queue]
        if self.tp.tp_size > 1:
            both = self.tp.all_reduce_min(torch.tensor(settled + [-f for f in failed], dtype=torch.int64)).tolist()
            settled, failed = both[: len(settled)], [-f for f in both[len(settled) :]]
        ready, kept = [], []
        for w, d, f in zip(self.queue, settled, failed, strict=True):
            if f:
                fail(w.msg.rid, *self._why(w))
            elif d:
                ready.append(w.msg)
            else:
                kept.append(w)
        self.queue = kept
        return ready

    def _failed(self, w: _Waiting, now: float) -> bool:
        """Failed on this rank: its compile was stopped or dropped, or it waited past its deadline for a worker (a
        running compile is stopped by the pool ``timeout_s`` after it started, a worker that does not start by
        ``WORKER_START_S``; past both it fails anyway)."""
        fut = w.compiled
        if fut.cancelled() or (fut.done() and isinstance(fut.exception(), GrammarCompileAborted)):
            return True
        waited = now >= w.deadline and not fut.running()
        return not fut.done() and (waited or now >= w.deadline + self.timeout_s + WORKER_START_S)

    def _why(self, w: _Waiting) -> tuple[str, ErrorCode]:
        kind = w.msg.sampling_params.grammar_key[0] if w.msg.sampling_params.grammar_key else "grammar"
        fut = w.compiled
        if fut.done() and not fut.cancelled() and isinstance(fut.exception(), GrammarCompileAborted):
            return str(fut.exception()), ErrorCode.INVALID_ARGUMENT
        if not fut.done() or fut.cancelled():
            workers = self.compiler().pool.workers
            return (f"the {kind} waited {self.timeout_s:g} s (--grammar-compile-timeout) for one of this node's "
                    f"{workers} grammar compile workers (--grammar-compile-workers); retry later",
                    ErrorCode.DEADLINE_EXCEEDED)
        return (f"the {kind} did not compile on every TP rank within {self.timeout_s:g} s "
                "(--grammar-compile-timeout); simplify it", ErrorCode.DEADLINE_EXCEEDED)


def _settled(fut: Future) -> bool:
    """Compiled, or refused by the grammar itself (the same on every rank)."""
    return fut.done() and not fut.cancelled() and not isinstance(fut.exception(), GrammarCompileAborted)
