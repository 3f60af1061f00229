"""A tokenize worker process: loads the model's tokenizer, then answers ``TokenizeJob`` frames on its socket.

Lifecycle: load the tokenizer -> send the ready frame -> loop (read job -> tokenize -> send result) until the
router closes the socket. The router kills a worker whose job it no longer wants (client gone, deadline) and forks
another from the fork server, which imported this module once and so loaded the tokenizer once (``PRELOADED``).
"""

from __future__ import annotations

import socket
import sys
from array import array
from typing import BinaryIO

from common import env
from common.errors import InvalidRequestError
from common.text.tokenizer import load_tokenizer
from router.tokenize_messages import HEADER_BYTES, JOB_DECODER, TokenizeJob, TokenizeResult, frame
from router.tokenizer import Tokenizer


def _preload() -> tuple[str, Tokenizer] | None:
    """Runs in the fork server (it imports this module): the tokenizer every forked worker then starts with."""
    path = env.tokenize_preload()
    return (path, Tokenizer(load_tokenizer(path))) if path else None


PRELOADED = _preload()


def worker_tokenizer(model_path: str, l1_bytes: int) -> Tokenizer:
    """The preloaded tokenizer (when it is the model's), with an L1 cache of ``l1_bytes`` (0: none) of its own."""
    preloaded = PRELOADED[1] if PRELOADED is not None and PRELOADED[0] == model_path else None
    if preloaded is not None and not l1_bytes:
        return preloaded
    return Tokenizer(preloaded.hf if preloaded is not None else load_tokenizer(model_path), l1_max_bytes=l1_bytes)


def serve(sock: socket.socket, model_path: str, l1_bytes: int = 0) -> None:
    """The worker process's entry point."""
    tok = worker_tokenizer(model_path, l1_bytes)
    with sock, sock.makefile("rb") as inp, sock.makefile("wb") as out:
        run(tok, inp, out)


def run(tok: Tokenizer, inp: BinaryIO, out: BinaryIO) -> None:
    out.write(frame(TokenizeResult()))
    out.flush()
    while (header := _read_exact(inp, HEADER_BYTES)) is not None:
        body = _read_exact(inp, int.from_bytes(header, "big"))
        if body is None:
            return
        out.write(frame(answer(tok, JOB_DECODER.decode(body))))
        out.flush()


def answer(tok: Tokenizer, job: TokenizeJob) -> TokenizeResult:
    try:
        if job.messages is not None:
            ids = tok.encode_chat([{"role": m.role, "content": m.content} for m in job.messages])
        else:
            ids = tok.encode(job.text or "")
    except InvalidRequestError as e:
        return TokenizeResult(invalid=str(e))
    packed = array("I", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return TokenizeResult(ids=packed.tobytes())


def _read_exact(f: BinaryIO, n: int) -> bytes | None:
    buf = f.read(n)
    return buf if buf is not None and len(buf) == n else None
