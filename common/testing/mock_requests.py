"""What a mock worker does with one request (``mock_worker``): the tokens it answers (``fake_tokens``, streamed by
``stream_tokens``), its record while in flight (``Active``) with waits that end early when it is aborted (``pause``,
``until``), and the P/D rendezvous by bootstrap room its two legs meet at (``MockHub``, standing in for the KV
transfer).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.testing.mock_config import MockConfig
from pdcluster.v1 import common_pb2, worker_pb2

FIRST_TOKEN = 5  # ids below are special tokens of the test tokenizer


def fake_tokens(input_ids: list[int], n: int, vocab_size: int, prior: int = 0) -> list[int]:
    """The mock model: n output ids, a deterministic function of the prompt. ``prior``: the last ``prior`` input
    ids are earlier outputs (a migrated request), so the output continues the prompt's sequence after them."""
    prompt = input_ids[: len(input_ids) - prior]
    base = (sum(prompt) * 2654435761 + len(prompt)) & 0xFFFFFFFF
    span = vocab_size - FIRST_TOKEN
    return [FIRST_TOKEN + (base + i * 40503) % span for i in range(prior, prior + n)]


def token_chunk(req: worker_pb2.GenerateRequest, ids: list[int]) -> worker_pb2.TokenChunk:
    """``ids`` as a streamed chunk, with made-up logprobs when the request asks for them."""
    c = worker_pb2.TokenChunk(token_ids=ids)
    if req.return_logprob or req.top_logprobs_num:
        c.logprobs.extend(-0.5 - (t % 7) / 10 for t in ids)
        for t in ids if req.top_logprobs_num else ():
            c.top_logprobs.add(
                token_ids=[t, (t + 1) % 1000 + FIRST_TOKEN][: req.top_logprobs_num],
                logprobs=[-0.5 - (t % 7) / 10, -3.0][: req.top_logprobs_num],
            )
    return c


def take(counter: int) -> tuple[bool, int]:
    """One use of a fault counter (N: the next N calls; -1: every call; 0: none): (fires, the counter after)."""
    if counter == 0:
        return False, 0
    return True, counter if counter < 0 else counter - 1


@dataclass
class Room:
    decode_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    prefill_done: asyncio.Future[tuple[int, int, str, int]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class MockHub:
    """The rendezvous of the mocks in one process, by bootstrap room (stands in for the KV transfer)."""

    def __init__(self) -> None:
        self.rooms: dict[int, Room] = {}

    def room(self, room: int) -> Room:
        r = self.rooms.get(room)
        if r is None:
            r = self.rooms[room] = Room()
        return r

    def fail(self, room: int, why: str) -> None:
        r = self.rooms.get(room)
        if r is not None and not r.prefill_done.done():
            r.prefill_done.set_exception(RuntimeError(why))


class Aborted(Exception):
    pass


@dataclass
class Active:
    rid: str
    rank: int
    pages: int
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


async def pause(a: Active, seconds: float) -> None:
    """Sleep ``seconds``, unless ``a`` is aborted first (Aborted)."""
    if a.aborted.is_set():
        raise Aborted
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(a.aborted.wait(), seconds)
            raise Aborted


async def until(a: Active, fut: asyncio.Future[Any], timeout: float, own: bool = False) -> Any:
    """``fut``'s result, unless aborted first (Aborted) or ``timeout`` passes (TimeoutError). ``own``: cancel
    ``fut`` when giving up on it."""
    waiter = asyncio.ensure_future(a.aborted.wait())
    try:
        done, _ = await asyncio.wait({fut, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if own and not fut.done():
            fut.cancel()
    if waiter in done or a.aborted.is_set():
        raise Aborted
    if fut not in done:
        raise TimeoutError
    return fut.result()


async def stream_tokens(
    cfg: MockConfig,
    a: Active,
    req: worker_pb2.GenerateRequest,
    context: grpc.aio.ServicerContext,
    cached: int,
    timing: common_pb2.Timing,
) -> Any:
    """The answer of a Decode or Generate call: ``fake_tokens`` up to the first stop id or max_new_tokens, in chunks
    of ``cfg.chunk_tokens`` paced by ``cfg.itl``, with the configured faults (before the first token, after some,
    before Finished)."""
    die, cfg.die_before_first_token = take(cfg.die_before_first_token)
    if die:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: worker died before the first token")
    if cfg.hang:
        await pause(a, 3600)
    n = req.sampling_params.max_new_tokens if req.sampling_params.HasField("max_new_tokens") else 128
    ids = fake_tokens(list(req.input_ids), n, cfg.vocab_size, req.prior_output_len)
    stop_ids = set(req.sampling_params.stop_token_ids)
    reason, matched = "length", None
    for i, t in enumerate(ids):
        if t in stop_ids:
            ids, reason, matched = ids[: i + 1], "stop", t
            break
    sent = 0
    while len(ids) - sent > cfg.chunk_tokens:
        if cfg.die_after_tokens is not None and sent >= cfg.die_after_tokens:
            await context.abort(cfg.die_code, f"injected: worker died after {sent} tokens")
        yield worker_pb2.GenerateResponse(chunk=token_chunk(req, ids[sent : sent + cfg.chunk_tokens]))
        sent += cfg.chunk_tokens
        await pause(a, cfg.itl)
    if cfg.die_before_finished:
        yield worker_pb2.GenerateResponse(chunk=token_chunk(req, ids[sent:]))
        await context.abort(cfg.die_code, "injected: worker died before its Finished message")
    fin = worker_pb2.Finished(
        last=token_chunk(req, ids[sent:]),
        finish_reason=reason,
        usage=common_pb2.Usage(
            prompt_tokens=len(req.input_ids), completion_tokens=len(ids), cached_tokens=cached
        ),
        timing=timing,
    )
    if matched is not None:
        fin.matched_token = matched
    yield worker_pb2.GenerateResponse(finished=fin)
