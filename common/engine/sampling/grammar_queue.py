"""``GrammarQueue``: requests that carry a grammar wait here, ahead of their role's first queue, until it compiles.

    front msg (json_schema / regex / ebnf) ──> GrammarQueue.add: compilation starts on the compiler's thread
    each step, before the role's poll: pop_ready ──> compiled everywhere: role.admit (then as any request)
                                                 └─> did not compile: INVALID_ARGUMENT naming the problem
                                                 └─> not compiled by its deadline: DEADLINE_EXCEEDED

The step never waits for a compilation. With TP, "compiled" and "expired" are agreed over the group (a MIN and a
MAX of the ranks' rank-local answers) so that every rank admits the same requests at the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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
        """The messages whose grammar is compiled on every rank (admit them; one that failed to compile is
        admitted too and refused by ``build_req``); expired ones are failed through ``fail(rid, message, code)``."""
        if not self.queue:
            return []
        now = time.monotonic()
        done = [int(w.compiled.done()) for w in self.queue]
        expired = [int(now >= w.deadline) for w in self.queue]
        if self.tp.tp_size > 1:
            both = self.tp.all_reduce_min(torch.tensor(done + [-e for e in expired], dtype=torch.int64)).tolist()
            done, expired = both[: len(done)], [-e for e in both[len(done) :]]
        ready, kept = [], []
        for w, d, e in zip(self.queue, done, expired, strict=True):
            if d:
                ready.append(w.msg)
            elif e:
                key = w.msg.sampling_params.grammar_key
                fail(w.msg.rid, f"the {key[0] if key else 'grammar'} did not compile within {self.timeout_s:g} s "
                     "(--grammar-compile-timeout); simplify it", ErrorCode.DEADLINE_EXCEEDED)
            else:
                kept.append(w)
        self.queue = kept
        return ready
