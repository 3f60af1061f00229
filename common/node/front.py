"""The front process of a node: the gRPC ``pdcluster.v1.Worker`` service over the node's scheduler ranks.

``WorkerServicer`` serves colocated mode (``Generate``) and the RPCs every role shares (``Abort``, ``GetLoad``,
``GetServerInfo``). The prefill and decode nodes subclass it to add ``Prefill`` / ``Decode``. Servicer methods
convert protobuf to internal messages and delegate; errors become gRPC status codes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from common.config import ServerArgs
from common.engine.io_struct import AbortReq, GenerateReqInput, TokenOut
from common.engine.model.config import ModelConfig
from common.errors import FAULT_METADATA_KEY, ErrorCode, InvalidRequestError
from common.node.convert import request_from_proto, token_out_to_proto
from common.node.metrics import observe_final, observe_itl
from common.node.ranks import RankClient
from common.node.worker_mux import MuxServing
from common.serving.drain_rate import DrainRate
from common.wire.worker_auth import MIN_NONCE_BYTES, ChallengeRefused, answer_challenge
from pdcluster.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


DEADLINE_SLACK_S = 0.1  # a cancel this close to the call's deadline counts as the deadline (``abort_code``)
STATUS = {code: grpc.StatusCode[code.value] for code in ErrorCode}  # total: every node code has its status


class WorkerServicer(MuxServing, worker_pb2_grpc.WorkerServicer):
    def __init__(self, args: ServerArgs, model_path: str, model_config: ModelConfig, ranks: RankClient) -> None:
        self.args = args
        self.model_path = model_path
        self.model_config = model_config
        self.ranks = ranks
        self.draining = False
        self.in_flight = [0] * args.dp_size  # requests each rank holds (running or queued), counted at the front
        self.max_in_flight = args.max_running_requests + args.max_queued_requests
        self.drained = [DrainRate() for _ in range(args.dp_size)]  # each rank's completions: the retry hint
        self.grpc_port = args.port  # the bound Worker port (the server sets it after binding port 0)

    # -- helpers shared by the roles -------------------------------------------------------------------------------
    async def fail(self, context: grpc.aio.ServicerContext, code: ErrorCode, message: str,
                   origin: str | None = None) -> None:
        if origin:
            context.set_trailing_metadata(((FAULT_METADATA_KEY, origin),))
        await context.abort(STATUS[code], message)

    def check_rank(self, rank: int | None, name: str) -> int:
        if rank is None:
            if self.args.dp_size > 1 and name != "dp_rank":
                raise InvalidRequestError(f"{name} is required: this node runs {self.args.dp_size} DP ranks")
            return self.ranks.least_loaded_rank() if rank is None else rank
        if not 0 <= rank < self.args.dp_size:
            raise InvalidRequestError(f"{name} {rank} is out of range: this node has DP ranks 0..{self.args.dp_size - 1}")
        return rank

    def check_role(self, rpc: str, mode: str) -> None:
        if self.args.disaggregation_mode != mode:
            raise InvalidRequestError(
                f"{rpc} is not served here: this node runs in disaggregation mode {self.args.disaggregation_mode!r}; "
                f"send {rpc} to a {mode!r} node"
            )
        if self.draining:
            raise _Unavailable("node is draining (shutting down); retry on another node")

    def timeout(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return self.args.request_timeout if remaining is None else min(remaining, self.args.request_timeout)

    async def run_request(
        self, msg: GenerateReqInput, rank: int, context: grpc.aio.ServicerContext,
        take: Callable[[Any], bool] | None = None,
    ) -> AsyncIterator[Any]:
        """Send one request to its rank and yield its outputs until the final one; abort it if the caller goes.
        ``take``: offered each output that arrives while this generator's consumer waits for the next with none
        pending (so every earlier output was consumed); True: taken (never yielded)."""
        items: deque[Any] = deque()
        waiting: asyncio.Future[None] | None = None

        def wake(item: Any) -> None:
            items.append(item)
            if waiting is not None and not waiting.done():
                waiting.set_result(None)

        def deliver(out: Any) -> None:  # called by the ranks' output dispatcher: never raises into it
            if take is not None and waiting is not None and not waiting.done() and not items:
                try:
                    if take(out):
                        return
                except Exception:  # the handler meets the same output, and its failure, on its own path
                    logger.exception("[rid=%s] sending an output from the ranks' callback failed", msg.rid)
            wake(out)

        if msg.rid in self.ranks.waiters:
            raise InvalidRequestError(f"request id {msg.rid!r} is already in flight on this node")
        if self.in_flight[rank] >= self.max_in_flight:
            wait = self.drained[rank].wait_s(self.in_flight[rank] - self.max_in_flight + 1)
            raise _Overloaded(
                f"DP rank {rank} holds {self.in_flight[rank]} requests, its limit (--max-running-requests + "
                f"--max-queued-requests); retry in {wait:.1f} s or on another node", wait)
        self.ranks.register(msg.rid, rank, deliver)
        self.in_flight[rank] += 1
        budget = self.timeout(context)  # NOTE: read once: the context's remaining time shrinks as it runs
        # One timer per request, not a wait_for per output (on Python 3.11 each wait_for is a task of its own).
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(budget, wake, _EXPIRED)
        finished = False
        expired = False
        try:
            self.ranks.send(rank, msg)
            while not finished:
                while not items:
                    waiting = loop.create_future()
                    await waiting
                out = items.popleft()
                if out is _EXPIRED:
                    expired = True
                    raise _Deadline(f"request {msg.rid} did not finish within {budget:.3g} s")
                finished = getattr(out, "finish_reason", None) is not None or not isinstance(out, TokenOut)
                if finished:
                    observe_final(out)
                yield out
        finally:
            expiry.cancel()
            if not finished:
                code = ErrorCode.DEADLINE_EXCEEDED if expired else abort_code(context)
                why = "deadline passed" if code == ErrorCode.DEADLINE_EXCEEDED else "client cancelled"
                self.ranks.send(rank, AbortReq(rid=msg.rid, reason=why, code=code))
            self.ranks.unregister(msg.rid)
            self.in_flight[rank] -= 1
            self.drained[rank].completed()

    async def guarded(self, context: grpc.aio.ServicerContext, agen: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Map typed errors raised while serving to gRPC status codes."""
        try:
            async for item in agen:
                yield item
        except InvalidRequestError as e:
            await self.fail(context, ErrorCode.INVALID_ARGUMENT, str(e))
        except _Unavailable as e:
            await self.fail(context, ErrorCode.UNAVAILABLE, str(e))
        except _Deadline as e:
            await self.fail(context, ErrorCode.DEADLINE_EXCEEDED, str(e))
        except _Overloaded as e:
            context.set_trailing_metadata((("retry-after-ms", str(int(e.retry_after_s * 1000))),))
            await self.fail(context, ErrorCode.RESOURCE_EXHAUSTED, str(e))

    async def stream_tokens(
        self, msg: GenerateReqInput, rank: int, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The request's responses. On a Mux stream (``context.sink``) a token chunk that arrives while the caller
        waits is sent from the ranks' output callback, without waking this request's task; the final message, an
        error, and whatever arrives while the task is busy are yielded."""
        last: float | None = None
        sink = getattr(context, "sink", None)

        def chunk(out: TokenOut) -> worker_pb2.GenerateResponse:
            nonlocal last
            now = time.monotonic()
            if last is not None:
                observe_itl(now - last, len(out.token_ids))
            last = now if out.token_ids else last
            return token_out_to_proto(out)

        def take(out: Any) -> bool:
            if (type(out) is not TokenOut or out.finish_reason is not None or out.error_code is not None
                    or context.cancelled()):
                return False
            sink(chunk(out))
            return True

        async for out in self.run_request(msg, rank, context, take if sink is not None else None):
            if out.error_code is not None:
                await self.fail(context, out.error_code, out.error or "request failed", out.error_origin)
            yield chunk(out)

    # -- RPCs ------------------------------------------------------------------------------------------------------
    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[
            worker_pb2.GenerateResponse]:
        async def body() -> AsyncIterator[worker_pb2.GenerateResponse]:
            self.check_role("Generate", "null")
            msg = request_from_proto(request)
            rank = self.check_rank(request.dp_rank if request.HasField("dp_rank") else None, "dp_rank")
            async for resp in self.stream_tokens(msg, rank, context):
                yield resp

        async for resp in self.guarded(context, body()):
            yield resp

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> Any:
        await self.fail(context, ErrorCode.INVALID_ARGUMENT, self._wrong_role("Prefill", "prefill"))

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> Any:
        await self.fail(context, ErrorCode.INVALID_ARGUMENT, self._wrong_role("Decode", "decode"))

    def _wrong_role(self, rpc: str, mode: str) -> str:
        return (f"{rpc} is not served here: this node runs in disaggregation mode {self.args.disaggregation_mode!r}; "
                f"send {rpc} to a {mode!r} node")

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> Any:
        rank = self.ranks.rid_rank.get(request.rid)
        if rank is not None:
            self.ranks.send(rank, AbortReq(rid=request.rid, reason="aborted through Worker.Abort"))
        return worker_pb2.AbortResponse(found=rank is not None)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            loads = await self.ranks.get_load()
        except TimeoutError:
            await self.fail(context, ErrorCode.UNAVAILABLE, "scheduler ranks did not report their load in time")
        return worker_pb2.GetLoadResponse(
            page_size=self.args.page_size,
            ranks=[
                worker_pb2.RankLoad(
                    dp_rank=q.dp_rank, running=q.running, waiting=q.waiting, bootstrap=q.bootstrap,
                    inflight=q.inflight, prealloc=q.prealloc, transfer=q.transfer, free_kv_pages=q.free_kv_pages,
                    total_kv_pages=q.total_kv_pages, free_req_slots=q.free_req_slots,
                    total_req_slots=q.total_req_slots, token_usage=q.token_usage, evictable_tokens=q.evictable_tokens,
                    admissible_tokens=q.admissible_tokens, preempt_priority=q.preempt_priority,
                    host_cache_tokens=q.hicache.host_tokens_total if q.hicache is not None else 0,
                    cache_storage=q.hicache.storage if q.hicache is not None else "",
                )
                for q in loads
            ],
        )

    async def GetServerInfo(self, request: worker_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext) -> Any:
        cfg = self.model_config
        return worker_pb2.ServerInfo(
            mode=self.args.disaggregation_mode,
            model_path=self.model_path,
            served_model_name=Path(self.model_path).name,
            model_fingerprint=json.dumps(cfg.fingerprint(), sort_keys=True),
            page_size=self.args.page_size,
            tp_size=self.args.tp_size,
            dp_size=self.args.dp_size,
            bootstrap_port=self.args.disaggregation_bootstrap_port if self.args.disaggregation_mode == "prefill" else 0,
            context_len=cfg.context_len,
            vocab_size=cfg.vocab_size,
            kv_transfer_backend=self.args.kv_transfer_backend if self.args.is_disaggregated else "",
            max_total_tokens=self.ranks.max_total_tokens,
            max_requests_per_rank=self.max_in_flight,
            schedule_low_priority_values_first=self.args.schedule_low_priority_values_first,
        )


    async def ProveMembership(self, request: worker_pb2.ProveMembershipRequest,
                              context: grpc.aio.ServicerContext) -> Any:
        try:
            proof = answer_challenge(request.nonce, request.address, self.grpc_port)
        except ChallengeRefused as e:
            short = len(request.nonce) < MIN_NONCE_BYTES
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT if short else grpc.StatusCode.PERMISSION_DENIED,
                                str(e))
        return worker_pb2.ProveMembershipResponse(proof=proof)


_EXPIRED = object()  # queued by a request's deadline timer, behind the outputs that arrived in time


def abort_code(context: Any) -> ErrorCode:
    """Why a request's handler is being left unfinished: its deadline passed, or its caller went (cancel)."""
    cancel_code = getattr(context, "cancel_code", None)  # a Mux request says so (common.node.worker_mux)
    if cancel_code is not None:
        deadline = cancel_code == grpc.StatusCode.DEADLINE_EXCEEDED
        return ErrorCode.DEADLINE_EXCEEDED if deadline else ErrorCode.CANCELLED
    # A per-request RPC: a caller whose deadline passes cancels the call (RST_STREAM), which can reach the handler
    # just before the node's copy of that deadline does; a cancel that close to it is the deadline.
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= DEADLINE_SLACK_S
    return ErrorCode.DEADLINE_EXCEEDED if expired else ErrorCode.CANCELLED


class _Unavailable(Exception):
    pass


class _Deadline(Exception):
    pass


class _Overloaded(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # from the rank's queue and its recent completion rate
