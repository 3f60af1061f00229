"""Grammar-constrained decoding with xgrammar: compiled grammars, per-request matchers, the token bitmask.

Why xgrammar: SGLang's and vLLM's default engine, maintained, runs on CPU (a C++ matcher; the bitmask is applied by
its CPU kernel or, on CUDA, its Triton/CUDA kernel), and compiles JSON Schema, regex and EBNF into one grammar type.

Lifecycle of a grammar request on one scheduler rank::

    front msg ──> GrammarQueue (common/engine/sampling/grammar_queue.py): ``GrammarCompiler.submit`` compiles in a
                  worker process (grammar_pool.py; json_schema.py makes a schema JSON-legal first), the message
                  waits, off the step's hot path, until every TP rank has it (or its deadline passes)
              ──> role.admit ──> build_req: ``RequestGrammar`` (a matcher; a migrated request replays its earlier
                  outputs into it)
    each step:    SamplingBatchInfo.from_reqs fills one bitmask row per grammar row (host, scheduler thread);
                  the sampler masks those rows' scores (device, outside any CUDA graph)
    each token:   ``RequestGrammar.accept`` (``Req.take_token``: a step's token, the decode node's first token
                  from the prefill node); the request stops when the grammar is complete, and ends as a dead end
                  (never garbage) when no token may continue it.

Every TP rank runs the same matchers on the same tokens: their masks are identical.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from common.engine.sampling.grammar_pool import Compiled, GrammarCompileAborted, GrammarCompilePool
from common.text.fast_tokenizer import FastTokenizer

if TYPE_CHECKING:
    import xgrammar

__all__ = ["GrammarCompileAborted", "GrammarCompiler", "RequestGrammar", "tokenizer_info"]

logger = logging.getLogger(__name__)

# Compiled grammars kept per rank (LRU; failures are cached too: the same source fails the same way), bounded in count
# and in bytes (xgrammar's estimate of what a compiled grammar holds).
GRAMMAR_CACHE_ENTRIES = 512
GRAMMAR_CACHE_BYTES = 512 << 20


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgrammar.TokenizerInfo:
    import xgrammar as xgr

    hf = tokenizer.transformers_tokenizer() if isinstance(tokenizer, FastTokenizer) else tokenizer
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids))
                                              or None)


class GrammarCompiler:
    """One rank's compiler: ``submit`` returns a future of the compiled grammar, shared by every request with the
    same ``(kind, source)``. Compiles run in worker processes (``GrammarCompilePool``: ``workers`` at once, each
    stopped ``timeout_s`` after it starts); a compiled grammar that leaves the cache gives its memory back to the OS."""

    def __init__(self, info: xgrammar.TokenizerInfo, any_whitespace: bool, workers: int = 1,
                 timeout_s: float = 30.0) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.info = info
        self.vocab_size = info.vocab_size
        self.any_whitespace = any_whitespace
        self.pool = GrammarCompilePool(info, workers, timeout_s)
        self._cache: OrderedDict[tuple[str, str], Future[Compiled]] = OrderedDict()
        self.cached_bytes = 0
        self._lock = threading.Lock()  # submit runs on the scheduler thread, completions on the pool's

    def submit(self, key: tuple[str, str]) -> Future[Compiled]:
        evicted = 0
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not fut.cancelled():
                self._cache.move_to_end(key)
                self.pool.keep(fut)
                return fut
            fut = self.pool.submit(key[0], key[1], self.any_whitespace)
            self._cache[key] = fut
            evicted = self._evict()
        fut.add_done_callback(lambda f: self._account(key, f))
        if evicted:
            release_freed_memory()
        return fut

    def _account(self, key: tuple[str, str], fut: Future[Compiled]) -> None:
        """A compile finished (on the pool's thread): count its bytes. A compile cancelled in the queue leaves the
        cache (a later request compiles it again); one stopped at its deadline stays, so the same grammar fails at
        once instead of taking a worker for the whole deadline again."""
        with self._lock:
            if self._cache.get(key) is not fut:
                return
            if fut.cancelled():
                del self._cache[key]
            elif fut.exception() is None:
                self.cached_bytes += fut.result().nbytes

    def _evict(self) -> int:
        """Drop least-recently-used entries over the budgets; how many held a compiled grammar. NOTE: only on the
        scheduler thread (from ``submit``), so a grammar settled in ``GrammarQueue.pop_ready`` is still cached when
        ``matcher`` builds the request in the same step."""
        evicted = 0
        while len(self._cache) > GRAMMAR_CACHE_ENTRIES or self.cached_bytes > GRAMMAR_CACHE_BYTES:
            _, old = self._cache.popitem(last=False)
            if old.done() and not old.cancelled() and old.exception() is None:
                self.cached_bytes -= old.result().nbytes
                evicted += 1
        return evicted

    def matcher(self, key: tuple[str, str]) -> RequestGrammar:
        """A fresh matcher over the compiled grammar of ``key`` (which must be compiled: ``submit(key).done()``);
        raises ``InvalidRequestError`` if it did not compile."""
        compiled = self.submit(key).result(timeout=0)
        return RequestGrammar(self._xgr.GrammarMatcher(compiled.grammar), key[0])

    def close(self) -> None:
        self.pool.close()


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc keeps them otherwise: a big grammar's memory would stay in the
    rank's RSS after it left the cache)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class RequestGrammar:
    """One request's matcher: where its output stands in the grammar."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, kind: str) -> None:
        self.matcher = matcher
        self.kind = kind

    def accept(self, token: int) -> bool:
        """Advance over ``token``; False (state unchanged) if the grammar does not allow it here."""
        return bool(self.matcher.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepts (speculative decoding checks drafts, then steps back)."""
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return bool(self.matcher.is_terminated())

    def dead_end_message(self, n_tokens: int) -> str:
        """Why a request whose grammar refused its token after ``n_tokens`` outputs ends (INVALID_ARGUMENT)."""
        return (f"the {self.kind} grammar reached a dead end after {n_tokens} output tokens: no token may continue it "
                "under the request's other constraints (min_new_tokens, stop_token_ids); relax them or the grammar")


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(scores: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``scores`` with the disallowed tokens of ``rows`` at -inf. A row with no allowed token left (the grammar's
    only continuations are masked by other constraints) keeps its scores: the matcher then refuses the token it
    draws and the request ends as a dead end instead of sampling from nothing."""
    import xgrammar as xgr

    masked = scores.index_select(0, rows)
    xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=vocab_size)
    dead = torch.isneginf(masked).all(dim=-1, keepdim=True)
    out = scores.clone()
    out[rows] = torch.where(dead, scores.index_select(0, rows), masked)
    return out
