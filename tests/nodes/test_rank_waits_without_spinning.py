"""A scheduler rank that only waits on other threads (here: a prefill request whose decode peer never shows up, so
it sits in the bootstrap queue) naps for input instead of spinning a core (``WAITING_NAP_MS`` in
``common.node.scheduler_process``): on a small host a spinning rank starves the transfer threads and the other
nodes it waits for."""

from __future__ import annotations

import random
import time

import psutil
import pytest

from pdcluster.v1 import worker_pb2
from tests.node_helpers import start_node
from tests.nodes.test_nodes import greedy_request

WATCH_S = 3.0


def _cpu_seconds(pid: int) -> float:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def test_prefill_rank_waiting_for_its_decode_peer_does_not_spin(model_path) -> None:
    prefill = start_node("prefill", model_path, extra=["--bootstrap-timeout", "30"])
    try:
        req = greedy_request("lonely", [random.Random(3).randrange(10, 1000) for _ in range(40)])
        leg = prefill.stub.Prefill.future(worker_pb2.PrefillRequest(request=req, bootstrap_room=77), timeout=60)
        deadline = time.monotonic() + 20
        while prefill.load().ranks[0].bootstrap == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prefill.load().ranks[0].bootstrap == 1, "the request never reached the bootstrap queue"
        before = _cpu_seconds(prefill.proc.pid)
        time.sleep(WATCH_S)
        used = _cpu_seconds(prefill.proc.pid) - before
        # Spinning takes a whole core (~WATCH_S); napping 1 ms per loop, a few percent of one.
        assert used < WATCH_S / 3, f"the node used {used:.2f} CPU s in {WATCH_S} s while only waiting"
        leg.cancel()
        prefill.wait_pools_free()
    finally:
        prefill.stop()


@pytest.fixture(scope="module")
def model_path():
    from tests.model_fixtures import make_tiny_model

    return make_tiny_model("llama")
