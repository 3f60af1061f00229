"""Prefill and decode nodes as real processes on 127.0.0.1, driven over gRPC without a router.

The decode node's tokens equal a colocated node's for the same greedy requests, for every KV transfer backend;
faults end in clear errors within their deadlines, and surviving nodes' pools return to their free counts.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import FAULT_METADATA_KEY, KV_PEER_FAULT
from common.wire.worker_auth import new_nonce, proof_matches
from kvtransfer.testing import backend_param
from pdcluster.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.node_helpers import Node, start_node

pytestmark = pytest.mark.slow

FAST_DEADLINES = ["--bootstrap-timeout", "6", "--waiting-timeout", "6", "--transfer-timeout", "6"]


def greedy_request(rid: str, ids: list[int], n: int = 10) -> worker_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    return worker_pb2.GenerateRequest(rid=rid, input_ids=ids, sampling_params=sp)


def tokens_of(stream: Iterator[worker_pb2.GenerateResponse]) -> tuple[list[int], worker_pb2.Finished]:
    ids: list[int] = []
    for resp in stream:
        if resp.HasField("chunk"):
            ids.extend(resp.chunk.token_ids)
        else:
            ids.extend(resp.finished.last.token_ids)
            return ids, resp.finished
    raise AssertionError("stream ended without a Finished message")


def run_pd(prefill: Node, decode: Node, req: worker_pb2.GenerateRequest, room: int, p_rank: int = 0,
           d_rank: int = 0, timeout: float = 60) -> tuple[list[int], worker_pb2.Finished, worker_pb2.PrefillResponse]:
    """Both legs at once, as the router does."""
    with ThreadPoolExecutor(1) as pool:
        pre = pool.submit(prefill.stub.Prefill, worker_pb2.PrefillRequest(
            request=req, bootstrap_room=room, prefill_dp_rank=p_rank), timeout=timeout)
        ids, fin = tokens_of(decode.stub.Decode(worker_pb2.DecodeRequest(
            request=req, bootstrap_room=room, bootstrap_addr=prefill.bootstrap_addr, prefill_dp_rank=p_rank,
            decode_dp_rank=d_rank), timeout=timeout))
        return ids, fin, pre.result()


def reference(colocated: Node, req: worker_pb2.GenerateRequest) -> list[int]:
    return tokens_of(colocated.stub.Generate(req, timeout=60))[0]


PROMPT_LENGTHS = [1, 3, 9, 17, 30, 45, 64, 65, 90, 120, 150, 200, 5, 77, 260, 33]


# One node pair per backend (CI time): page sizes 1 and 16 and overlap off are spread over the backends; dp 2 runs
# on nixl in ``pd_dp2`` below (every (prefill rank, decode rank) combination).
@pytest.mark.parametrize(
    ("backend", "page_size", "overlap"),
    [("tcp", 16, True), ("nccl", 1, False), ("ucx", 1, True), ("shm", 16, True), ("nixl", 16, True),
     backend_param("mooncake", 1, True)],
)
def test_pd_tokens_match_colocated(model_path, colocated, backend, page_size, overlap) -> None:
    extra = ["--page-size", str(page_size), "--chunked-prefill-size", "64"]
    extra.append("--enable-overlap-schedule" if overlap else "--disable-overlap-schedule")
    prefill = start_node("prefill", model_path, backend=backend, extra=extra, wait=False)
    decode = start_node("decode", model_path, backend=backend, extra=extra, wait=False)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        rng = random.Random(len(backend))
        reqs = [greedy_request(f"{backend}-{i}", [rng.randrange(10, 1000) for _ in range(n)])
                for i, n in enumerate(PROMPT_LENGTHS)]
        expected = [reference(colocated, r) for r in reqs]
        rooms = rng.sample(range(1, 2**63), len(reqs))
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda a: run_pd(prefill, decode, *a), zip(reqs, rooms, strict=True)))
        for req, want, (got, fin, pre) in zip(reqs, expected, results, strict=True):
            assert got == want, f"prompt of {len(req.input_ids)} tokens"
            assert fin.finish_reason == "length" and fin.usage.completion_tokens == len(want)
            assert pre.prompt_tokens == len(req.input_ids)
            assert fin.timing.transfer_bytes > 0
        prefill.wait_pools_free()
        decode.wait_pools_free()
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def pd_dp2(model_path) -> Iterator[tuple[Node, Node]]:
    """dp 2 on both nodes over ``nixl`` (one-sided WRITEs, one agent per rank): the tests below are the
    control plane's, and the matrix above covers every backend at dp 1 (tcp, the default, everywhere else)."""
    extra = ["--chunked-prefill-size", "32", *FAST_DEADLINES]
    prefill = start_node("prefill", model_path, backend="nixl", dp_size=2, extra=extra, wait=False)
    decode = start_node("decode", model_path, backend="nixl", dp_size=2, extra=extra, wait=False)
    prefill.wait_ready()
    decode.wait_ready()
    yield prefill, decode
    prefill.stop()
    decode.stop()


def test_dp2_requests_spread_over_ranks(pd_dp2, colocated) -> None:
    _match_over_every_rank_pair(*pd_dp2, colocated)


@pytest.mark.parametrize("backend", [backend_param("mooncake")])
def test_dp2_pair_matches_colocated(model_path, colocated, backend) -> None:
    """dp 2 on the other field engine (nixl's dp 2 pair is ``pd_dp2``): one Mooncake engine per rank, every
    (prefill rank, decode rank) combination token-identical to colocated."""
    extra = ["--chunked-prefill-size", "32", *FAST_DEADLINES]
    prefill = start_node("prefill", model_path, backend=backend, dp_size=2, extra=extra, wait=False)
    decode = start_node("decode", model_path, backend=backend, dp_size=2, extra=extra, wait=False)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        _match_over_every_rank_pair(prefill, decode, colocated)
    finally:
        prefill.stop()
        decode.stop()


def _match_over_every_rank_pair(prefill: Node, decode: Node, colocated) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(5)
    reqs = [greedy_request(f"dp-{i}", [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 120))])
            for i in range(12)]
    expected = [reference(colocated, r) for r in reqs]
    args = [(r, rng.randrange(1, 2**63), i % 2, (i // 2) % 2) for i, r in enumerate(reqs)]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda a: run_pd(prefill, decode, *a), args))
    assert [r[0] for r in results] == expected
    prefill.wait_pools_free()
    decode.wait_pools_free()


def test_min_tokens_and_stop_ids_match_colocated(pd_dp2, colocated) -> None:
    """The first token is sampled on the prefill node: min_new_tokens must mask stop ids there as colocated does."""
    prefill, decode = pd_dp2
    ids = [11, 22, 33, 44, 55]
    first = reference(colocated, greedy_request("min-ref", ids, n=1))[0]
    sp = common_pb2.SamplingParams(max_new_tokens=6, min_new_tokens=1, temperature=0, ignore_eos=True,
                                   stop_token_ids=[first])
    req = worker_pb2.GenerateRequest(rid="min-tok", input_ids=ids, sampling_params=sp)
    expected, expected_fin = tokens_of(colocated.stub.Generate(req, timeout=60))
    assert expected[0] != first  # colocated masked the stop id on the first token
    got, fin, _ = run_pd(prefill, decode, req, room=424242)
    assert got == expected and fin.finish_reason == expected_fin.finish_reason
    # Without min_new_tokens both stop at once on the stop id.
    sp0 = common_pb2.SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[first])
    req0 = worker_pb2.GenerateRequest(rid="min-tok0", input_ids=ids, sampling_params=sp0)
    got0, fin0, _ = run_pd(prefill, decode, req0, room=424243)
    assert got0 == reference(colocated, req0) == [first] and fin0.finish_reason == "stop"
    prefill.wait_pools_free()
    decode.wait_pools_free()


def test_prefix_sharing_reports_cached_tokens(pd_dp2, colocated) -> None:
    prefill, decode = pd_dp2
    prefix = list(range(100, 180))
    first = greedy_request("pfx-0", [*prefix, 7, 8])
    second = greedy_request("pfx-1", [*prefix, 9, 10, 11])
    _, _, pre0 = run_pd(prefill, decode, first, 11, p_rank=1, d_rank=0)
    got, fin, pre1 = run_pd(prefill, decode, second, 12, p_rank=1, d_rank=1)
    assert pre0.cached_tokens == 0
    assert pre1.cached_tokens >= len(prefix) - 1
    assert fin.usage.cached_tokens == pre1.cached_tokens
    assert got == reference(colocated, second)


def rpc_code(fn, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as exc:
        result = fn(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, worker_pb2.PrefillResponse):
            list(result)
    return exc.value.code(), exc.value.details()


def test_bad_inputs_get_invalid_argument(pd_dp2, colocated) -> None:
    prefill, decode = pd_dp2
    req = greedy_request("bad", [1, 2, 3])
    cases = [
        (prefill.stub.Prefill, worker_pb2.PrefillRequest(request=req, prefill_dp_rank=0), "bootstrap_room"),
        (prefill.stub.Prefill, worker_pb2.PrefillRequest(request=req, bootstrap_room=1, prefill_dp_rank=5),
         "prefill_dp_rank"),
        (prefill.stub.Prefill, worker_pb2.PrefillRequest(request=req, bootstrap_room=1), "prefill_dp_rank"),
        (decode.stub.Decode, worker_pb2.DecodeRequest(request=req, bootstrap_addr="x:1", decode_dp_rank=0),
         "bootstrap_room"),
        (decode.stub.Decode, worker_pb2.DecodeRequest(request=req, bootstrap_room=1, decode_dp_rank=0),
         "bootstrap_addr"),
        (decode.stub.Decode, worker_pb2.DecodeRequest(request=req, bootstrap_room=1, bootstrap_addr="x:1",
                                                      decode_dp_rank=2), "decode_dp_rank"),
        (prefill.stub.Generate, req, "prefill"),
        (decode.stub.Prefill, worker_pb2.PrefillRequest(request=req, bootstrap_room=1), "decode"),
        (colocated.stub.Decode, worker_pb2.DecodeRequest(request=req, bootstrap_room=1, bootstrap_addr="x:1"),
         "null"),
        (colocated.stub.Generate, greedy_request("long", [5] * 5000), "context"),
        (colocated.stub.Generate, worker_pb2.GenerateRequest(rid="e", input_ids=[]), "input_ids"),
        (colocated.stub.Generate, worker_pb2.GenerateRequest(
            rid="t", input_ids=[1], sampling_params=common_pb2.SamplingParams(temperature=-1)), "temperature"),
        (prefill.stub.Prefill, worker_pb2.PrefillRequest(request=greedy_request("cap", [5] * 4500),
                                                         bootstrap_room=3, prefill_dp_rank=0), "context"),
    ]
    for fn, request, word in cases:
        code, details = rpc_code(fn, request, timeout=20)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (word, code, details)
        assert word in details, (word, details)
    prefill.wait_pools_free()
    decode.wait_pools_free()


def test_decode_leg_cancel_frees_both_sides(pd_dp2) -> None:
    prefill, decode = pd_dp2
    req = greedy_request("cancel", list(range(10, 60)), n=3000)
    pre = prefill.stub.Prefill.future(worker_pb2.PrefillRequest(request=req, bootstrap_room=77, prefill_dp_rank=0),
                                      timeout=30)
    stream = decode.stub.Decode(worker_pb2.DecodeRequest(
        request=req, bootstrap_room=77, bootstrap_addr=prefill.bootstrap_addr, decode_dp_rank=0), timeout=30)
    got = 0
    for resp in stream:
        got += len(resp.chunk.token_ids)
        if got >= 5:
            stream.cancel()
            break
    pre.result()  # the KV had arrived before the cancel: the prefill leg succeeded
    decode.wait_pools_free()
    prefill.wait_pools_free()


def test_abort_before_transfer_fails_other_leg(pd_dp2) -> None:
    """Decode waits for KV that never comes; Abort on the decode node ends both legs."""
    prefill, decode = pd_dp2
    req = greedy_request("abort-d", list(range(10, 40)))
    stream = decode.stub.Decode(worker_pb2.DecodeRequest(
        request=req, bootstrap_room=91, bootstrap_addr=prefill.bootstrap_addr, decode_dp_rank=1), timeout=30)
    threading.Timer(1.0, lambda: decode.stub.Abort(worker_pb2.AbortRequest(rid="abort-d"))).start()
    with pytest.raises(grpc.RpcError) as exc:
        list(stream)
    assert exc.value.code() == grpc.StatusCode.CANCELLED
    decode.wait_pools_free()
    prefill.wait_pools_free()


def test_prefill_without_decode_fails_by_deadline(pd_dp2) -> None:
    prefill, _ = pd_dp2
    req = greedy_request("lonely", list(range(10, 40)))
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as exc:
        prefill.stub.Prefill(worker_pb2.PrefillRequest(request=req, bootstrap_room=4242, prefill_dp_rank=0),
                             timeout=60)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc.value.details()
    assert time.monotonic() - start < 30
    prefill.wait_pools_free()


def test_prefill_killed_mid_transfer(model_path) -> None:
    extra = ["--chunked-prefill-size", "16", *FAST_DEADLINES]
    decode = start_node("decode", model_path, extra=extra, wait=False)
    prefill = start_node("prefill", model_path, extra=extra, wait=False)
    try:
        decode.wait_ready()
        # A kill that lands after the last chunk reached decode tests nothing (the stream then ends normally): on a
        # fast run that happens, so the request is tried again on a fresh prefill node, three times at most.
        for attempt in range(3):
            prefill.wait_ready()
            room = 5 + attempt
            req = greedy_request(f"victim-{attempt}", [random.Random(1).randrange(10, 1000) for _ in range(1500)])
            stream = decode.stub.Decode(worker_pb2.DecodeRequest(
                request=req, bootstrap_room=room, bootstrap_addr=prefill.bootstrap_addr), timeout=60)
            # Held: a dropped future cancels its RPC, and the prefill would abort the room before the kill.
            prefill_leg = prefill.stub.Prefill.future(worker_pb2.PrefillRequest(request=req, bootstrap_room=room),
                                                      timeout=60)
            deadline = time.monotonic() + 20
            while decode.load().ranks[0].transfer == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not prefill_leg.done(), "the prefill leg ended before the kill"
            prefill.kill()
            start = time.monotonic()
            try:
                list(stream)
            except grpc.RpcError as e:
                error = e
                break
            prefill.stop()
            prefill = start_node("prefill", model_path, extra=extra, wait=False)
        else:
            pytest.fail("every transfer was complete before its prefill node was killed (3 attempts)")
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), error.details()
        assert time.monotonic() - start < 20
        # the decode node blames its KV peer, so the router charges the prefill node's circuit, not its own
        assert (FAULT_METADATA_KEY, KV_PEER_FAULT) in [tuple(m) for m in error.trailing_metadata() or ()]
        decode.wait_pools_free()
    finally:
        prefill.stop()
        decode.stop()


def test_decode_killed_mid_stream(model_path, colocated) -> None:
    prefill = start_node("prefill", model_path, extra=FAST_DEADLINES, wait=False)
    decode = start_node("decode", model_path, extra=FAST_DEADLINES, wait=False)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        victim = greedy_request("long-out", list(range(10, 50)), n=3000)
        stream = decode.stub.Decode(worker_pb2.DecodeRequest(
            request=victim, bootstrap_room=9, bootstrap_addr=prefill.bootstrap_addr), timeout=60)
        pre = prefill.stub.Prefill.future(worker_pb2.PrefillRequest(request=victim, bootstrap_room=9), timeout=60)
        # A second request is stuck waiting for KV when decode dies: its prefill leg must fail, not hang.
        waiting = greedy_request("orphan", list(range(10, 30)))
        orphan = prefill.stub.Prefill.future(worker_pb2.PrefillRequest(request=waiting, bootstrap_room=10),
                                             timeout=60)
        got = 0
        with pytest.raises(grpc.RpcError) as exc:
            for resp in stream:
                got += len(resp.chunk.token_ids)
                if got >= 3:
                    decode.kill()
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert pre.result().prompt_tokens == 40
        with pytest.raises(grpc.RpcError) as orphan_exc:
            orphan.result()
        assert orphan_exc.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        prefill.wait_pools_free()
    finally:
        prefill.stop()
        decode.stop()


def test_node_rpcs_without_the_cluster_credential_are_refused(pd_dp2) -> None:
    """A guessed-id Abort, GetRank, GetServerInfo, Decode: UNAUTHENTICATED without the credential; health is open."""
    prefill, decode = pd_dp2
    req = greedy_request("victim", list(range(10, 40)))
    victim = decode.stub.Decode(worker_pb2.DecodeRequest(
        request=req, bootstrap_room=92, bootstrap_addr=prefill.bootstrap_addr, decode_dp_rank=0), timeout=30)
    with grpc.insecure_channel(decode.addr) as bare, grpc.insecure_channel(prefill.addr) as bare_p:
        rogue, rogue_p = worker_pb2_grpc.WorkerStub(bare), worker_pb2_grpc.WorkerStub(bare_p)
        for call in (lambda: rogue.Abort(worker_pb2.AbortRequest(rid="victim"), timeout=5),
                     lambda: rogue.GetServerInfo(worker_pb2.GetServerInfoRequest(), timeout=5),
                     lambda: list(rogue.Decode(worker_pb2.DecodeRequest(request=req), timeout=5))):
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:
            rogue_p.GetServerInfo(worker_pb2.GetServerInfoRequest(), timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        # Membership: the one Worker RPC open without the credential, answered only for the node's own gRPC port.
        nonce = new_nonce()
        proof = rogue.ProveMembership(worker_pb2.ProveMembershipRequest(nonce=nonce, address=decode.addr), timeout=5)
        assert proof_matches(proof.proof, nonce, decode.addr)
        with pytest.raises(grpc.RpcError) as exc:
            rogue.ProveMembership(worker_pb2.ProveMembershipRequest(nonce=nonce, address=prefill.addr), timeout=5)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # The victim's stream was not aborted by the rogue: it ends by the real Abort only.
    time.sleep(0.5)
    decode.stub.Abort(worker_pb2.AbortRequest(rid="victim"))
    with pytest.raises(grpc.RpcError) as exc:
        list(victim)
    assert exc.value.code() == grpc.StatusCode.CANCELLED
    decode.wait_pools_free()
    prefill.wait_pools_free()
