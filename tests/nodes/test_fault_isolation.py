"""One request's internal error fails that request with INTERNAL and frees its pages; the rank keeps serving.
An error that leaves a rank's state unknown (in the forward) takes the node down with a non-zero exit code.

Faults come from the test-only hook ``common.faults`` (``PDCLUSTER_FAULT`` in the node's environment)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.faults import FAULT_ENV
from pdcluster.v1 import common_pb2, worker_pb2
from tests.model_fixtures import make_tiny_model
from tests.node_helpers import Node, start_node, wait_all

pytestmark = pytest.mark.slow
PROMPT = [5, 9, 13, 17, 21, 25, 29, 33]


def generate(node: Node, rid: str, n: int = 6) -> list[int]:
    sp = common_pb2.SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    out: list[int] = []
    for resp in node.stub.Generate(worker_pb2.GenerateRequest(rid=rid, input_ids=PROMPT, sampling_params=sp),
                                   timeout=60):
        out.extend(resp.chunk.token_ids if resp.HasField("chunk") else resp.finished.last.token_ids)
    return out


@pytest.fixture(scope="module")
def faulty() -> Iterator[Node]:
    mp = pytest.MonkeyPatch()
    mp.setenv(FAULT_ENV, "token:bad-token,input:bad-input")
    try:
        node = start_node("null", make_tiny_model("llama"))
    finally:
        mp.undo()
    yield node
    node.stop()


@pytest.mark.parametrize("bad", ["bad-token", "bad-input"])
def test_one_bad_request_fails_alone_with_internal(faulty, bad) -> None:
    reference = generate(faulty, f"ref-{bad}")
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(generate, faulty, f"good-{bad}-{i}") for i in range(3)]
        failing = pool.submit(generate, faulty, bad)
        with pytest.raises(grpc.RpcError) as e:
            failing.result(60)
        assert all(f.result(60) == reference for f in good)  # the same batch went on untouched
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "internal error" in e.value.details() and f"fault for request {bad}" in e.value.details()
    assert faulty.proc.poll() is None
    faulty.wait_pools_free(30)  # the failed request's pages and slot came back
    assert generate(faulty, f"after-{bad}") == reference


def test_forward_error_takes_the_node_down_with_nonzero_exit() -> None:
    mp = pytest.MonkeyPatch()
    mp.setenv(FAULT_ENV, "forward:boom")
    try:
        node = start_node("null", make_tiny_model("llama"))
    finally:
        mp.undo()
    try:
        with pytest.raises(grpc.RpcError) as e:
            generate(node, "boom")
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        deadline = time.monotonic() + 60
        while node.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node.proc.returncode not in (None, 0), node.log()
        assert "a scheduler rank died" in node.log()
    finally:
        node.kill()


@pytest.fixture(scope="module")
def faulty_pd() -> Iterator[tuple[Node, Node]]:
    model = make_tiny_model("llama")
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv(FAULT_ENV, "token:p-bad")
        prefill = start_node("prefill", model, wait=False)  # the environment is read at spawn
        mp.setenv(FAULT_ENV, "transfer:d-bad-transfer,token:d-bad-token")
        decode = start_node("decode", model, wait=False)
    finally:
        mp.undo()
    wait_all([prefill, decode])
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.mark.parametrize("rid", ["p-bad", "d-bad-transfer", "d-bad-token"])
async def test_pd_internal_error_fails_the_attempt_and_the_router_retries(faulty_pd, rid) -> None:
    from router.config import RouterConfig, WorkerSpec
    from router.server import RouterServer

    prefill, decode = faulty_pd
    server = RouterServer(RouterConfig(
        model_path=str(make_tiny_model("llama")), grpc_port=0, http_port=None,
        workers=(WorkerSpec(prefill.addr, "prefill", prefill.bootstrap_port), WorkerSpec(decode.addr, "decode")),
        retry_backoff_s=0.01,
    ))
    await server.start()
    try:
        from pdcluster.v1 import router_pb2, router_pb2_grpc

        async with grpc.aio.insecure_channel(server.grpc_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            req = router_pb2.RouterGenerateRequest(
                request_id=rid, input_ids=router_pb2.TokenIds(ids=PROMPT),
                sampling_params=common_pb2.SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
            msgs = [m async for m in stub.Generate(req, timeout=60)]
        done = msgs[-1].complete
        assert done.usage.completion_tokens == 6
        assert done.attempts == 2  # the first attempt failed on the injected error, the retry (rid#1) succeeded
    finally:
        await server.stop()
    for node in faulty_pd:
        assert node.proc.poll() is None
        node.wait_pools_free(30)
    assert "internal error" in (prefill.log() if rid.startswith("p-") else decode.log())
