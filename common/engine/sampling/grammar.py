"""Grammar-constrained decoding with xgrammar: compiled grammars, per-request matchers, the token bitmask.

Why xgrammar: SGLang's and vLLM's default engine, maintained, runs on CPU (a C++ matcher; the bitmask is applied by
its CPU kernel or, on CUDA, its Triton/CUDA kernel), and compiles JSON Schema, regex and EBNF into one grammar type.

Lifecycle of a grammar request on one scheduler rank::

    front msg ──> GrammarQueue (common/engine/sampling/grammar_queue.py): ``GrammarCompiler.submit`` compiles on a thread,
                  the message waits, off the step's hot path, until every TP rank has it (or its deadline passes)
              ──> role.admit ──> build_req: ``RequestGrammar`` (a matcher; a migrated request replays its earlier
                  outputs into it)
    each step:    SamplingBatchInfo.from_reqs fills one bitmask row per grammar row (host, scheduler thread);
                  the sampler masks those rows' scores (device, outside any CUDA graph)
    each token:   ``RequestGrammar.accept`` (scheduler_output.append_token; the decode node with the prefill
                  node's first token); the request stops when the grammar is complete, and ends as a dead end
                  (never garbage) when no token may continue it.

Every TP rank runs the same matchers on the same tokens: their masks are identical.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from common.engine.req import Finished, FinishReason, Req
from common.errors import ErrorCode, InvalidRequestError
from common.text.fast_tokenizer import FastTokenizer

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# Compiled grammars kept per rank (LRU; failures are cached too: the same source fails the same way).
GRAMMAR_CACHE_ENTRIES = 512
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "; the client needs the rest.
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def grammar_error_message(kind: str, exc: BaseException) -> str:
    """What a client reads when its grammar does not compile: which field, and xgrammar's reason."""
    text = " ".join(_XGR_PREFIX.sub("", str(exc)).split())
    return f"{kind} cannot be compiled into a grammar: {text[:500]}"


class GrammarCompiler:
    """One rank's compiler: ``submit`` returns a future of the compiled grammar, shared by every request with the
    same ``(kind, source)``. Compilation runs on one background thread (xgrammar releases the GIL)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], any_whitespace: bool) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        stops = sorted(set(stop_token_ids)) or None
        hf = tokenizer.transformers_tokenizer() if isinstance(tokenizer, FastTokenizer) else tokenizer
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops)
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(1, "pdcluster-grammar")
        self._cache: OrderedDict[tuple[str, str], Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # NOTE: the cache is read by the scheduler thread only; the lock is cheap

    def submit(self, key: tuple[str, str]) -> Future[xgrammar.CompiledGrammar]:
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, *key)
            self._cache[key] = fut
            while len(self._cache) > GRAMMAR_CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, kind: str, source: str) -> xgrammar.CompiledGrammar:
        try:
            if kind == "json_schema":
                return self._compiler.compile_json_schema(source, any_whitespace=self.any_whitespace)
            if kind == "regex":
                return self._compiler.compile_regex(source)
            if kind == "ebnf":
                return self._compiler.compile_grammar(source)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse and conversion errors
            raise InvalidRequestError(grammar_error_message(kind, e)) from None
        raise InvalidRequestError(f"unknown grammar kind {kind!r}")

    def matcher(self, key: tuple[str, str]) -> RequestGrammar:
        """A fresh matcher over the compiled grammar of ``key`` (which must be compiled: ``submit(key).done()``);
        raises ``InvalidRequestError`` if it did not compile."""
        compiled = self.submit(key).result(timeout=0)
        return RequestGrammar(self._xgr.GrammarMatcher(compiled), key[0])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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


def dead_end_message(kind: str, n_tokens: int) -> str:
    return (f"the {kind} grammar reached a dead end after {n_tokens} output tokens: no token may continue it under "
            "the request's other constraints (min_new_tokens, stop_token_ids); relax them or the grammar")


def accept_grammar_token(req: Req, token: int) -> bool:
    """Advance the request's grammar over ``token`` (before it is appended to its output). A token the grammar
    refuses (drawn only when no token may continue it) is dropped and the request ends as a dead end."""
    if req.grammar is None or req.grammar.accept(token):
        return True
    req.abort(dead_end_message(req.grammar.kind, len(req.generated_ids())), ErrorCode.INVALID_ARGUMENT)
    return False


def finish_on_grammar(req: Req, token: int) -> None:
    """A complete grammar ends the request even where its stop token would not (``ignore_eos``)."""
    if req.grammar is not None and not req.finished() and req.grammar.is_terminated():
        req.finished_reason = Finished(FinishReason.STOP, matched=token)


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
