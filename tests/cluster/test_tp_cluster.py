"""``pdcluster up`` with heterogeneous TP (prefill tp 2, decode tp 1): the router's greedy outputs equal a colocated
tp 1 node's, and a TP rank killed on one prefill node fails that node only: the router retries on the other
prefill node before the first token, so every request still completes, and the decode node's pools come back."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.cluster.test_cluster_e2e import reference_ids, start_up, stop_up, wait_nodes_idle
from tests.node_helpers import rank_pids

pytestmark = pytest.mark.slow


def test_up_prefill_tp2_decode_tp1(model_path, colocated) -> None:
    cluster = start_up(model_path, "--prefill", "2", "--decode", "1", "--prefill-tp-size", "2",
                       "--decode-tp-size", "1")
    try:
        assert len(rank_pids(cluster.pids["prefill-0"])) == 2 and len(rank_pids(cluster.pids["decode-0"])) == 1
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}"))
        sp = common_pb2.SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)

        def run(ids: list[int]) -> list[int]:
            req = router_pb2.RouterGenerateRequest(input_ids=router_pb2.TokenIds(ids=ids), sampling_params=sp)
            return next(list(r.complete.output_ids) for r in stub.Generate(req, timeout=90)
                        if r.HasField("complete"))

        prompts = [list(range(20 + i, 20 + i + 9 * (i + 1))) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(run, prompts))
        assert got == [reference_ids(colocated, p, 8) for p in prompts]
        wait_nodes_idle(cluster, ["prefill-0", "prefill-1", "decode-0"])

        # TP rank 1 of prefill-0 dies: prefill-0 stops (its group is broken), the router routes around it.
        os.kill(max(rank_pids(cluster.pids["prefill-0"])), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            try:
                os.kill(cluster.pids["prefill-0"], 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "prefill-0 kept running with a dead TP rank"
            time.sleep(0.2)
        more = [list(range(300 + i, 340 + 7 * i)) for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(run, more))
        assert got == [reference_ids(colocated, p, 8) for p in more]
        wait_nodes_idle(cluster, ["prefill-1", "decode-0"])
        assert re.search(r"prefill-0 \(pid \d+\) exited with code 1", cluster.log.read_text())
    finally:
        stop_up(cluster)
