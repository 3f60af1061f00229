"""A mock ``pdcluster.v1.Worker`` (grpc.aio) in any role, for router tests and benchmarks.

- Roles: ``prefill``, ``decode``, ``colocated`` (mode ``null``); serves ``grpc.health.v1`` too.
- PD pairing like the real nodes, through a ``MockHub`` shared by the mocks of one process: ``Prefill(room)`` waits
  until a ``Decode`` with the same room arrived, takes ``service_time``, then hands the first token to that decode
  leg; ``Decode`` streams nothing before the matching prefill finished, and checks that it was sent the prefill
  node's bootstrap address and prefill DP rank. Either side fails when the other does not come within
  ``pair_timeout``; an abort on one side fails the other.
- Output tokens are a deterministic function of the input ids (``mock_requests.fake_tokens``); a request with
  ``prior_output_len`` continues the sequence its prompt started.
- Faults: fail the next N Prefill calls, die before the first token, die after K tokens, report no free KV pages,
  hang, or stop serving health.
- Records what it received (``records``: kind, rid, room, ranks, bootstrap address) and the aborts (``aborts``);
  ``calls``: every RPC's method and the ``x-pdcluster-credential`` value it carried ("" when none).
- Membership: answers ``ProveMembership`` like a node, with ``secret`` (default: the cluster secret of the test
  environment; a wrong one makes a rogue worker). It does not enforce the credential itself.

A fleet of them in one process, and the model folder a router in front of them loads: ``mock_fleet``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.errors import FAULT_METADATA_KEY, KV_PEER_FAULT
from common.node.mux_socket_server import MuxSocketServer
from common.node.worker_mux import MuxServing
from common.ports import pick_free_port
from common.testing.mock_config import MODE, MockConfig
from common.testing.mock_requests import (
    Aborted,
    Active,
    MockHub,
    fake_tokens,
    pause,
    stream_tokens,
    take,
    until,
)
from common.wire.worker_auth import METADATA_KEY, ChallengeRefused, answer_challenge
from pdcluster.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class _CallRecorder(grpc.aio.ServerInterceptor):
    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self._calls = calls

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        credential = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY, "")
        self._calls.append((handler_call_details.method.rsplit("/", 1)[-1], str(credential)))
        return await continuation(handler_call_details)


class MockWorker(MuxServing, worker_pb2_grpc.WorkerServicer):
    def __init__(self, cfg: MockConfig, hub: MockHub | None = None) -> None:
        self.cfg = cfg
        self.hub = hub or MockHub()
        self.records: list[dict[str, Any]] = []
        self.aborts: list[str] = []
        self.cancelled: list[str] = []  # rids whose Prefill/Decode/Generate call its caller cancelled (or let expire)
        self.calls: list[tuple[str, str]] = []  # (method, credential metadata or "")
        self.active: dict[str, Active] = {}
        self.cache: list[set[int]] = [set() for _ in range(cfg.dp_size)]
        self.port = 0
        self.bootstrap_port = 0
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._mux_socket: MuxSocketServer | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> str:
        server = grpc.aio.server(interceptors=[_CallRecorder(self.calls)])
        worker_pb2_grpc.add_WorkerServicer_to_server(self, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        tls = self.cfg.tls
        # Unless given, a port outside the kernel's ephemeral range (pick_free_port): a test that stops this worker
        # and starts it again on that port must not find it taken by an outgoing connection meanwhile.
        for attempt in range(20):
            address = f"127.0.0.1:{port or pick_free_port()}"
            try:
                self.port = (server.add_secure_port(address, tls.grpc_server_credentials()) if tls is not None
                             else server.add_insecure_port(address))
                break
            except RuntimeError:  # a given port is busy, or a picked one was taken between the pick and the bind
                if port or attempt == 19:
                    raise
        if self.cfg.role == "prefill":
            self.bootstrap_port = pick_free_port()
        await server.start()
        if self.cfg.serve_mux and self.cfg.mux_socket:
            # Any credential is served (recorded in ``calls`` as "Mux-socket"), as the gRPC port is.
            self._mux_socket = MuxSocketServer(self, None, tls.server_ssl_context() if tls is not None else None,
                                               on_hello=lambda c: self.calls.append(("Mux-socket", c)))
            self.mux_socket_port = await self._mux_socket.start("127.0.0.1")
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        return self.address

    async def stop(self, grace: float | None = 0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self._mux_socket is not None:
            await self._mux_socket.stop()
            self._mux_socket = None
            self.mux_socket_port = 0

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._health.set("", status)

    def received(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind]

    # -- helpers ---------------------------------------------------------------------------------------------
    def _begin(self, kind: str, req: worker_pb2.GenerateRequest, rank: int, **extra: Any) -> Active:
        self.records.append(
            {
                "kind": kind,
                "rid": req.rid,
                "rank": rank,
                "input_ids": list(req.input_ids),
                "max_new_tokens": req.sampling_params.max_new_tokens,
                "min_new_tokens": req.sampling_params.min_new_tokens,
                "prior_output_len": req.prior_output_len,
                "priority": req.priority if req.HasField("priority") else None,
                "seed": req.sampling_params.seed if req.sampling_params.HasField("seed") else None,
                **extra,
            }
        )
        pages = -(-(len(req.input_ids) + req.sampling_params.max_new_tokens) // self.cfg.page_size)
        a = self.active[req.rid] = Active(req.rid, rank, pages)
        return a

    def _cached(self, rank: int, ids: list[int], insert: bool) -> int:
        ps, blocks, h = self.cfg.page_size, self.cache[rank], 0
        hashes = []
        for start in range(0, len(ids) - ps + 1, ps):
            h = hash((h, *ids[start : start + ps]))
            hashes.append(h)
        n = 0
        for x in hashes:
            if x not in blocks:
                break
            n += 1
        if insert:
            blocks.update(hashes)
        return min(n * ps, len(ids) - 1)

    def _check_rank(self, rank: int, name: str) -> str | None:
        if not 0 <= rank < self.cfg.dp_size:
            return f"{name} {rank} out of range for dp_size {self.cfg.dp_size}"
        return None

    # -- Worker API ------------------------------------------------------------------------------------------
    async def Mux(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        if not self.cfg.serve_mux:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        await super().Mux(request_iterator, context)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> Any:
        req, rank = request.request, request.prefill_dp_rank
        a = self._begin(
            "prefill", req, rank, room=request.bootstrap_room if request.HasField("bootstrap_room") else None
        )
        try:
            if self.cfg.role != "prefill":
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"Prefill sent to a {self.cfg.role} node"
                )
            if not request.HasField("bootstrap_room"):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bootstrap_room is required")
            if (bad := self._check_rank(rank, "prefill_dp_rank")) is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad)
            fail, self.cfg.fail_prefill = take(self.cfg.fail_prefill)
            if fail:
                await context.abort(self.cfg.fail_code, self.cfg.fail_message)
            if self.cfg.hang:
                await pause(a, 3600)
            room = self.hub.room(request.bootstrap_room)
            t0 = time.monotonic()
            try:
                await until(
                    a, asyncio.ensure_future(room.decode_arrived.wait()), self.cfg.pair_timeout, own=True
                )
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "bootstrap timed out: no decode leg came"
                )
            t1 = time.monotonic()
            await pause(a, self.cfg.service_time)
            cached = self._cached(rank, list(req.input_ids), insert=True)
            first = fake_tokens(list(req.input_ids), 1, self.cfg.vocab_size, req.prior_output_len)[0]
            if not room.prefill_done.done():
                room.prefill_done.set_result((first, cached, f"127.0.0.1:{self.bootstrap_port}", rank))
            return worker_pb2.PrefillResponse(
                rid=req.rid,
                prompt_tokens=len(req.input_ids),
                cached_tokens=cached,
                timing=common_pb2.Timing(bootstrap=t1 - t0, prefill=time.monotonic() - t1),
            )
        except Aborted:
            self.hub.fail(request.bootstrap_room, "prefill aborted")
            await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
        finally:
            self.active.pop(req.rid, None)
            if context.cancelled():
                self.cancelled.append(req.rid)
                self.hub.fail(request.bootstrap_room, "prefill cancelled")

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> Any:
        req, rank = request.request, request.decode_dp_rank
        a = self._begin(
            "decode",
            req,
            rank,
            room=request.bootstrap_room if request.HasField("bootstrap_room") else None,
            bootstrap_addr=request.bootstrap_addr,
            prefill_dp_rank=request.prefill_dp_rank,
        )
        try:
            if self.cfg.role != "decode":
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"Decode sent to a {self.cfg.role} node"
                )
            if not request.HasField("bootstrap_room"):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bootstrap_room is required")
            if (bad := self._check_rank(rank, "decode_dp_rank")) is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad)
            room = self.hub.room(request.bootstrap_room)
            room.decode_arrived.set()
            t0 = time.monotonic()
            try:
                _first, cached, paddr, prank = await until(a, room.prefill_done, self.cfg.pair_timeout)
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "waiting for KV timed out: no prefill leg"
                )
            except RuntimeError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}")
            finally:
                self.hub.rooms.pop(request.bootstrap_room, None)
            if (paddr, prank) != (request.bootstrap_addr, request.prefill_dp_rank):
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"bootstrap mismatch: sent {request.bootstrap_addr}/rank "
                    f"{request.prefill_dp_rank}, prefill ran on {paddr}/rank {prank}",
                )
            peer_fault, self.cfg.kv_peer_fault = take(self.cfg.kv_peer_fault)
            if peer_fault:
                context.set_trailing_metadata(((FAULT_METADATA_KEY, KV_PEER_FAULT),))
                await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: the prefill peer went silent")
            transfer = time.monotonic() - t0
            async for msg in stream_tokens(self.cfg, a, req, context, cached, common_pb2.Timing(transfer=transfer)):
                yield msg
        except Aborted:
            await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
        finally:
            self.active.pop(req.rid, None)
            if context.cancelled():
                self.cancelled.append(req.rid)

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> Any:
        rank = request.dp_rank if request.HasField("dp_rank") else 0
        a = self._begin("generate", request, rank)
        try:
            if self.cfg.role != "colocated":
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"Generate sent to a {self.cfg.role} node"
                )
            if (bad := self._check_rank(rank, "dp_rank")) is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad)
            await pause(a, self.cfg.service_time)
            cached = self._cached(rank, list(request.input_ids), insert=True)
            async for msg in stream_tokens(self.cfg, a, request, context, cached, common_pb2.Timing()):
                yield msg
        except Aborted:
            await context.abort(grpc.StatusCode.CANCELLED, "request aborted")
        finally:
            self.active.pop(request.rid, None)
            if context.cancelled():
                self.cancelled.append(request.rid)

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> Any:
        self.aborts.append(request.rid)
        a = self.active.get(request.rid)
        if a is not None:
            a.aborted.set()
        return worker_pb2.AbortResponse(found=a is not None)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> Any:
        cfg = self.cfg
        ranks = []
        for r in range(cfg.dp_size):
            mine = [a for a in self.active.values() if a.rank == r]
            used = sum(a.pages for a in mine)
            free = cfg.free_kv_pages if cfg.free_kv_pages is not None else cfg.total_kv_pages - used
            ranks.append(
                worker_pb2.RankLoad(
                    dp_rank=r,
                    running=len(mine),
                    free_kv_pages=free,
                    total_kv_pages=cfg.total_kv_pages,
                    token_usage=1 - free / cfg.total_kv_pages,
                    admissible_tokens=cfg.admissible_tokens,
                    preempt_priority=cfg.preempt_priority,
                )
            )
        return worker_pb2.GetLoadResponse(ranks=ranks, page_size=cfg.page_size)

    async def GetServerInfo(
        self, request: worker_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        cfg = self.cfg
        return worker_pb2.ServerInfo(
            mode=MODE[cfg.role],
            model_path=f"/models/{cfg.model_name}",
            served_model_name=cfg.model_name,
            model_fingerprint=json.dumps({"arch": "mock"}),
            page_size=cfg.page_size,
            tp_size=1,
            dp_size=cfg.dp_size,
            bootstrap_port=self.bootstrap_port if cfg.report_bootstrap_port else 0,
            context_len=cfg.context_len,
            vocab_size=cfg.vocab_size,
            kv_transfer_backend="fake",
            max_total_tokens=cfg.total_kv_pages * cfg.page_size,
            max_requests_per_rank=cfg.max_requests_per_rank,
            schedule_low_priority_values_first=cfg.schedule_low_priority_values_first,
        )

    async def ProveMembership(
        self, request: worker_pb2.ProveMembershipRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            proof = answer_challenge(request.nonce, request.address, self.port, self.cfg.secret)
        except ChallengeRefused as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        return worker_pb2.ProveMembershipResponse(proof=proof)
