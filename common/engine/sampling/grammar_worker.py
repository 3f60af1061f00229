"""A grammar compile worker: a child process of one scheduler rank that compiles grammars one at a time.

    parent (GrammarCompilePool) ── (kind, source, any_whitespace) ──> worker: convert, then compile
        <── ("ok", the converted grammar as JSON, exiting) or ("invalid", message for the client, exiting)

The worker compiles too, so that the whole cost runs under its deadline and memory cap, but it hands back the
converted grammar: small, where a compiled grammar's serialized tables can be many times its size in memory.
The pool compiles it again in the rank, a compile the worker has just shown to finish within the deadline.

The worker is disposable: the pool SIGKILLs it when a compile passes its deadline (xgrammar cannot stop a compile any
other way), and it exits by itself once a compile left its heap ``RECYCLE_BYTES`` larger than it started, so a big
compile's memory goes back to the OS with the process. Its heap is capped at ``MEMORY_BUDGET_BYTES`` over its start
(RLIMIT_DATA): a compile that needs more fails instead of swapping the host.

Imported by the forkserver that forks the workers (``preload``), so a fresh worker starts without importing anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import resource
import signal
from multiprocessing.connection import Connection

import xgrammar as xgr

from common.engine.sampling.json_schema import prepare_json_schema
from common.errors import InvalidRequestError

RECYCLE_BYTES = 128 << 20
MEMORY_BUDGET_BYTES = 2 << 30
PR_SET_PDEATHSIG = 1
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "; the client needs the rest.
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def grammar_error_message(kind: str, exc: BaseException) -> str:
    """What a client reads when its grammar does not compile: which field, and xgrammar's reason."""
    text = " ".join(_XGR_PREFIX.sub("", str(exc)).split())
    return f"{kind} cannot be compiled into a grammar: {text[:500]}"


def to_grammar(kind: str, source: str, any_whitespace: bool) -> xgr.Grammar:
    """``source`` converted into a grammar (JSON Schema, regex or EBNF); ``InvalidRequestError`` naming the field and
    xgrammar's reason if it does not convert. The conversion is where expensive sources spend their time."""
    if kind == "json_schema":
        source = prepare_json_schema(source)
    try:
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(source, any_whitespace=any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(source)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(source)
    except (RuntimeError, ValueError, TypeError, MemoryError) as e:  # xgrammar's parse and conversion errors
        raise InvalidRequestError(grammar_error_message(kind, e)) from None
    raise InvalidRequestError(f"unknown grammar kind {kind!r}")


def compile_grammar(compiler: xgr.GrammarCompiler, kind: str, source: str, any_whitespace: bool
                    ) -> xgr.CompiledGrammar:
    """Convert and compile one grammar (``to_grammar``, then the token-mask tables for ``compiler``'s vocabulary)."""
    grammar = to_grammar(kind, source, any_whitespace)
    try:
        return compiler.compile_grammar(grammar)
    except (RuntimeError, ValueError, TypeError, MemoryError) as e:
        raise InvalidRequestError(grammar_error_message(kind, e)) from None


def _heap_bytes() -> int:
    """The process's data segment and private anonymous mappings (what RLIMIT_DATA counts), from /proc."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def run_worker(conn: Connection, tokenizer_info_json: str) -> None:
    """The worker's loop: one job at a time until the pool closes the pipe (or the heap outgrew its start)."""
    with contextlib.suppress(OSError):  # die with the forkserver, which dies with the scheduler rank
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole process group; the rank stops us
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = _heap_bytes()
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_DATA, (start + MEMORY_BUDGET_BYTES, resource.RLIM_INFINITY))
    conn.send(("ready", None, False))
    while True:
        try:
            kind, source, any_whitespace = conn.recv()
        except (EOFError, OSError):
            return
        try:
            grammar = to_grammar(kind, source, any_whitespace)
            compiler.compile_grammar(grammar)  # the whole cost, under this process's deadline and memory cap
            reply = ("ok", grammar.serialize_json())
        except InvalidRequestError as e:
            reply = ("invalid", str(e))
        except (MemoryError, RuntimeError) as e:  # std::bad_alloc under the RLIMIT_DATA cap, or xgrammar's error
            memory = isinstance(e, MemoryError) or "bad_alloc" in str(e)
            reply = ("invalid", f"{kind} needs more than {MEMORY_BUDGET_BYTES >> 20} MiB to compile; simplify it"
                     if memory else grammar_error_message(kind, e))
        exiting = _heap_bytes() - start > RECYCLE_BYTES
        conn.send((*reply, exiting))
        if exiting:
            return
