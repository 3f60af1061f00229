"""Membership proof and sanity of reported facts: a worker that cannot prove the cluster secret gets no credential and
no request; a relay cannot borrow a real node's proof; absurd or disagreeing facts keep a worker unroutable; clients
see worker names, never addresses."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import grpc
import pytest

from common.node.front import WorkerServicer
from common.testing.mock_config import MockConfig
from common.testing.mock_worker import MockWorker
from common.wire.worker_auth import WorkerAuthInterceptor, new_nonce, proof_matches
from pdcluster.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from router.admin import bearer_metadata
from router.membership import challenge
from router.testing import eventually, fleet

ADMIN = bearer_metadata(os.environ["PDCLUSTER_CLUSTER_TOKEN"])
CREDENTIALED = {"Prefill", "Decode", "Generate", "Abort", "GetLoad", "GetServerInfo"}


def gen(rid: str) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        request_id=rid, text="Hello world", sampling_params=common_pb2.SamplingParams(max_new_tokens=3))


def rejections(f, role: str, reason: str) -> float:  # type: ignore[no-untyped-def]
    value = f.server.service.metrics.registry.get_sample_value(
        "pdcluster_router_worker_rejections_total", {"role": role, "reason": reason})
    return value or 0.0


async def listed(f, address: str) -> router_pb2.WorkerStatus:  # type: ignore[no-untyped-def]
    resp = await f.stub().ListWorkers(router_pb2.ListWorkersRequest(), metadata=ADMIN)
    return next(w for w in resp.workers if w.address == address)


async def test_rogue_worker_gets_no_credential_and_no_prompt_while_a_legit_one_is_admitted() -> None:
    async with fleet(prefill=1, decode=1, decode_policy="round_robin") as f:
        rogue = MockWorker(MockConfig(role="decode", secret="not-the-cluster-secret-at-all"), f.decode[0].hub)
        legit = MockWorker(MockConfig(role="decode"), f.decode[0].hub)
        await rogue.start()
        await legit.start()
        try:
            stub = f.stub()
            for w in (rogue, legit):
                await stub.RegisterWorker(router_pb2.RegisterWorkerRequest(
                    address=w.address, role=router_pb2.WORKER_ROLE_DECODE), metadata=ADMIN)
            status = await listed(f, rogue.address)
            assert status.state == "rejected" and "does not hold this cluster's secret" in status.error
            assert (await listed(f, legit.address)).state == "ready"
            for i in range(6):
                msgs = [m async for m in stub.Generate(gen(f"m{i}"))]
                assert msgs[-1].complete.usage.completion_tokens == 3
            await asyncio.sleep(0.35)  # several health rounds: each re-challenges the rogue
            assert legit.received("decode") and not rogue.records
            assert {m for m, _ in rogue.calls} <= {"ProveMembership", "Check"}
            assert all(credential == "" for _, credential in rogue.calls)
            assert sum(m == "ProveMembership" for m, _ in rogue.calls) >= 2
            assert any(credential for m, credential in legit.calls if m in CREDENTIALED)
            assert not any(credential for m, credential in legit.calls if m == "ProveMembership")
            assert rejections(f, "decode", "wrong_proof") >= 2
            assert not f.server.service.registry.workers[rogue.address].routable
        finally:
            await rogue.stop()
            await legit.stop()


class _Relay(worker_pb2_grpc.WorkerServicer):
    """Listens on its own port and forwards ProveMembership to a real node (as-is, or naming the node's address)."""

    def __init__(self, node: worker_pb2_grpc.WorkerStub, node_address: str, rewrite: bool) -> None:
        self.node, self.node_address, self.rewrite = node, node_address, rewrite

    async def ProveMembership(self, request, context):  # type: ignore[no-untyped-def]
        if self.rewrite:
            request = worker_pb2.ProveMembershipRequest(nonce=request.nonce, address=self.node_address)
        try:
            return await self.node.ProveMembership(request)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")


async def _serve(servicer: worker_pb2_grpc.WorkerServicer, interceptors: list) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=interceptors)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def test_node_proves_only_for_its_own_port_so_a_relay_cannot_borrow_the_proof() -> None:
    args = SimpleNamespace(dp_size=1, max_running_requests=1, max_queued_requests=1, port=0)
    node = WorkerServicer(args, "m", None, None)  # type: ignore[arg-type]
    node_server, node_port = await _serve(node, [WorkerAuthInterceptor()])
    node.grpc_port = node_port
    node_address = f"127.0.0.1:{node_port}"
    servers = [node_server]
    try:
        async with grpc.aio.insecure_channel(node_address) as bare:  # no credential: only ProveMembership answers
            stub = worker_pb2_grpc.WorkerStub(bare)
            nonce = new_nonce()
            proof = (await stub.ProveMembership(worker_pb2.ProveMembershipRequest(
                nonce=nonce, address=node_address))).proof
            assert proof_matches(proof, nonce, node_address)
            assert not proof_matches(proof, new_nonce(), node_address)
            assert (await challenge(stub, node_address, 5.0)).proven
            for request, code in ((worker_pb2.ProveMembershipRequest(nonce=nonce, address="127.0.0.1:1"),
                                   grpc.StatusCode.PERMISSION_DENIED),
                                  (worker_pb2.ProveMembershipRequest(nonce=b"short", address=node_address),
                                   grpc.StatusCode.INVALID_ARGUMENT)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.ProveMembership(request)
                assert e.value.code() == code
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetServerInfo(worker_pb2.GetServerInfoRequest())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for rewrite, reason in ((False, "refused"), (True, "wrong_proof")):
                relay_server, relay_port = await _serve(_Relay(stub, node_address, rewrite), [])
                servers.append(relay_server)
                relay_address = f"127.0.0.1:{relay_port}"
                async with grpc.aio.insecure_channel(relay_address) as to_relay:
                    verdict = await challenge(worker_pb2_grpc.WorkerStub(to_relay), relay_address, 5.0)
                assert not verdict.proven and verdict.reason == reason
    finally:
        for s in servers:
            await s.stop(None)


async def test_absurd_or_disagreeing_facts_keep_a_worker_unroutable() -> None:
    # context_len=2 used to make the router reject every real request.
    async with fleet(prefill=1, decode=[{"context_len": 2}, {}]) as f:
        tiny, good = f.decode
        status = await listed(f, tiny.address)
        assert status.state == "rejected" and "context_len=2" in status.error
        assert f.server.service.inputs.worker_context_len == 2048
        long_prompt = router_pb2.RouterGenerateRequest(
            request_id="long", input_ids=router_pb2.TokenIds(ids=list(range(10, 400))),
            sampling_params=common_pb2.SamplingParams(max_new_tokens=3))
        msgs = [m async for m in f.stub().Generate(long_prompt)]
        assert msgs[-1].complete.usage.completion_tokens == 3 and not tiny.records and good.received("decode")
        assert rejections(f, "decode", "info") >= 1

        late = [MockWorker(MockConfig(role="decode", **kw), good.hub)
                for kw in ({"context_len": 1024}, {"page_size": 8}, {"free_kv_pages": 10**6})]
        for w in late:
            await w.start()
        try:
            for w in late:
                await f.stub().RegisterWorker(router_pb2.RegisterWorkerRequest(
                    address=w.address, role=router_pb2.WORKER_ROLE_DECODE), metadata=ADMIN)
            errors = [(await listed(f, w.address)).error for w in late]
            assert "context_len 1024 (the fleet's: 2048)" in errors[0]
            assert "page_size 8 (the fleet's: 16)" in errors[1]
            await eventually(lambda: "free_kv_pages=1000000 of 4096" in
                             f.server.service.registry.workers[late[2].address].error)
            assert [f.server.service.registry.workers[w.address].routable for w in late] == [False] * 3
            assert f.server.service.inputs.worker_context_len == 2048
            for i in range(4):
                msgs = [m async for m in f.stub().Generate(gen(f"f{i}"))]
                assert msgs[-1].complete.usage.completion_tokens == 3
            assert not any(w.records for w in late)
        finally:
            for w in late:
                await w.stop()


async def test_served_by_names_workers_without_addresses() -> None:
    async with fleet(prefill=1, decode=1) as f:
        msgs = [m async for m in f.stub().Generate(gen("n1"))]
        served = msgs[-1].complete.served_by
        r = await f.openai().completions.create(model="mock-model", prompt="Hello world", max_tokens=2)
        for text in (served, r.model_extra["pdcluster"]["served_by"]):
            assert text == "prefill-0 -> decode-0" and "127.0.0.1" not in text
        assert (await listed(f, f.decode[0].address)).name == "decode-0"



async def test_a_router_without_the_secret_admits_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_CLUSTER_TOKEN", "")
    monkeypatch.delenv("PDCLUSTER_CLUSTER_TOKEN_FILE", raising=False)
    verdict = await challenge(None, "127.0.0.1:1", 1.0)  # type: ignore[arg-type]  # never reaches a node
    assert not verdict.proven and verdict.reason == "no_secret" and "PDCLUSTER_CLUSTER_TOKEN" in verdict.detail
