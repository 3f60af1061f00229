"""Tensor parallelism across real node processes on 127.0.0.1: colocated and disaggregated nodes with TP ranks
produce exactly the tokens of a colocated tp 1 node, with P tp != D tp in both directions and DP beside TP, and
every rank's pools return to their free counts (``GetLoad`` reports the MIN over a group's ranks).
"""

from __future__ import annotations

import functools
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.ports import pick_free_port
from pdcluster.v1 import worker_pb2
from tests.node_helpers import rank_pids, start_node
from tests.nodes.test_nodes import FAST_DEADLINES, greedy_request, reference, run_pd, tokens_of

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [1, 9, 17, 40, 64, 65, 130, 200]


def requests(tag: str, seed: int) -> list:
    rng = random.Random(seed)
    return [greedy_request(f"{tag}-{i}", [rng.randrange(10, 1000) for _ in range(n)])
            for i, n in enumerate(PROMPT_LENGTHS)]


def tp_args(tp: int) -> list[str]:
    return ["--tp-size", str(tp), "--page-size", "16", "--chunked-prefill-size", "64"]


def test_colocated_tp2_node_matches_tp1(model_path, colocated) -> None:
    node = start_node("null", model_path, extra=tp_args(2))
    try:
        assert len(rank_pids(node.proc.pid)) == 2
        reqs = requests("co-tp2", 7)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda r: tokens_of(node.stub.Generate(r, timeout=60))[0], reqs))
        assert got == [reference(colocated, r) for r in reqs]
        node.wait_pools_free()
    finally:
        node.stop()


@pytest.mark.parametrize(
    ("backend", "pairs"),
    # (P tp, P dp, D tp) pairs; P tp 2 -> D tp 1 over tcp runs with P dp 2 (DP beside TP). Every backend runs both
    # heterogeneous directions; one set of nodes per backend serves all its pairs (node starts dominate the cost).
    [("tcp", [(1, 1, 2), (2, 2, 2), (2, 2, 1)]), ("shm", [(2, 1, 1), (1, 1, 2)]), ("nccl", [(2, 1, 1), (1, 1, 2)])],
)
def test_pd_with_tp_matches_colocated_tp1(model_path, colocated, backend, pairs) -> None:
    prefills = {(p_tp, p_dp): None for p_tp, p_dp, _ in pairs}
    decodes = {d_tp: None for _, _, d_tp in pairs}
    nodes = []
    try:
        for key in prefills:
            prefills[key] = start_node("prefill", model_path, backend=backend, dp_size=key[1],
                                       extra=tp_args(key[0]), wait=False)
            nodes.append(prefills[key])
        for d_tp in decodes:
            decodes[d_tp] = start_node("decode", model_path, backend=backend, extra=tp_args(d_tp), wait=False)
            nodes.append(decodes[d_tp])
        for node in nodes:
            node.wait_ready(timeout=240)  # four nodes start at once on the 2-core runner
        for p_tp, p_dp, d_tp in pairs:
            prefill, decode = prefills[(p_tp, p_dp)], decodes[d_tp]
            reqs = requests(f"pd-{p_tp}{d_tp}{backend}{p_dp}", p_tp * 10 + d_tp)
            rooms = random.Random(p_tp + d_tp).sample(range(1, 2**63), len(reqs))
            p_ranks = [i % p_dp for i in range(len(reqs))]
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(functools.partial(run_pd, prefill, decode), reqs, rooms, p_ranks))
            for req, (got, fin, pre) in zip(reqs, results, strict=True):
                assert got == reference(colocated, req), f"P tp {p_tp} dp {p_dp} -> D tp {d_tp}: " \
                                                         f"prompt of {len(req.input_ids)} tokens"
                assert fin.finish_reason == "length" and pre.prompt_tokens == len(req.input_ids)
            if d_tp > 1:
                assert_choices_share_the_prompt(colocated, prefill, decode, f"n3-{p_tp}{d_tp}{backend}{p_dp}")
        for node in nodes:
            node.wait_pools_free()
    finally:
        for node in nodes:
            node.stop()


def assert_choices_share_the_prompt(colocated, prefill, decode, tag: str) -> None:
    """Three requests with one prompt (an ``n = 3`` request's choices) on a decode node with TP ranks: every rank
    holds the prompt's full pages once (one transfer carries them, the others only the last page), and the tokens
    are the colocated node's."""
    prompt = [random.Random(tag).randrange(10, 1000) for _ in range(70)]  # 4 full pages of 16 shared, then 6 tokens
    reqs = [greedy_request(f"{tag}-{i}", prompt, n=40) for i in range(3)]
    rooms = random.Random(tag).sample(range(1, 2**63), len(reqs))
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(functools.partial(run_pd, prefill, decode), reqs, rooms))
    expected = reference(colocated, reqs[0])
    assert [got for got, _, _ in results] == [expected] * 3
    moved = sorted(fin.timing.transfer_bytes for _, fin, _ in results)
    assert moved == [moved[0], moved[0], moved[0] * 5], moved


def test_killed_tp_rank_fails_its_node_and_frees_the_peer(model_path) -> None:
    """One TP rank of a prefill node dies while transfers are open: the node's requests fail UNAVAILABLE naming
    the rank, the node stops (no rank of the broken group serves alone), and the decode node's requests that
    waited on it fail and free every page."""
    prefill = start_node("prefill", model_path, extra=[*tp_args(2), *FAST_DEADLINES], wait=False)
    decode = start_node("decode", model_path, extra=[*tp_args(1), *FAST_DEADLINES], wait=False)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        reqs = requests("kill", 3)[:4]
        rooms = random.Random(5).sample(range(1, 2**63), len(reqs))
        with ThreadPoolExecutor(4) as pool:
            # Prefill legs without a decode peer wait in the bootstrap queue; decode legs whose prefill leg never
            # comes hold their pages waiting for KV. Both are open when the rank dies.
            pre = [pool.submit(prefill.stub.Prefill, worker_pb2.PrefillRequest(request=r, bootstrap_room=room),
                               timeout=30) for r, room in zip(reqs[:2], rooms[:2], strict=True)]
            dec = [pool.submit(lambda r, room: tokens_of(decode.stub.Decode(worker_pb2.DecodeRequest(
                request=r, bootstrap_room=room, bootstrap_addr=prefill.bootstrap_addr), timeout=30)), r, room)
                for r, room in zip(reqs[2:], rooms[2:], strict=True)]
            deadline = time.monotonic() + 10
            while decode.load().ranks[0].transfer + decode.load().ranks[0].prealloc < 2:
                assert time.monotonic() < deadline, "decode legs did not reach the transfer queue"
                time.sleep(0.1)
            follower = max(rank_pids(prefill.proc.pid))  # spawned second: TP rank 1
            os.kill(follower, signal.SIGKILL)
            for fut in pre:
                with pytest.raises(grpc.RpcError) as err:
                    fut.result(timeout=30)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
                assert "dp=0 tp=1 exited with code -9" in str(err.value.details())
            for fut in dec:
                with pytest.raises(grpc.RpcError) as err:
                    fut.result(timeout=40)
                assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert prefill.proc.wait(30) != 0, "a prefill node whose TP rank died must stop with an error"
        decode.wait_pools_free(timeout=40)
    finally:
        prefill.stop()
        decode.stop()


def test_tp_group_spanning_two_hosts_matches_tp1(model_path, colocated) -> None:
    """``--nnodes 2``: node 0 (the Worker service) and node 1 (ranks only) each run one TP rank of one group,
    meeting at ``--dist-init-addr`` (two processes on this host stand for two hosts)."""
    rendezvous = f"127.0.0.1:{pick_free_port()}"
    multi = [*tp_args(2), "--nnodes", "2", "--dist-init-addr", rendezvous]
    leader = start_node("null", model_path, extra=[*multi, "--node-rank", "0"], wait=False)
    log = Path(tempfile.mkstemp(prefix="pdcluster-node1-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "common.app.cli", "serve", "--model-path", str(model_path), "--host", "127.0.0.1",
           "--max-total-tokens", "4096", "--max-running-requests", "32", "--torch-num-threads", "1", *multi,
           "--node-rank", "1"]
    with open(log, "wb") as out:
        worker = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        leader.wait_ready()
        assert len(rank_pids(leader.proc.pid)) == 1 and len(rank_pids(worker.pid)) == 1
        reqs = requests("hosts", 11)[:5]
        got = [tokens_of(leader.stub.Generate(r, timeout=60))[0] for r in reqs]
        assert got == [reference(colocated, r) for r in reqs]
        leader.wait_pools_free()
        assert "TP host ready: node rank 1/2, tp ranks [1] of 2" in log.read_text()
    finally:
        leader.stop()
        try:
            worker.wait(30)  # the leader's ShutdownReq reaches rank 1 through the group; its host then stops
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
            raise


def test_mismatched_layout_fails_at_the_handshake_naming_both(model_path) -> None:
    """A decode node whose KV layout the prefill ranks cannot fill (another page size) is refused at the
    handshake: the request fails FAILED_PRECONDITION with both sides' layouts named, and nothing leaks."""
    prefill = start_node("prefill", model_path, extra=[*tp_args(2), *FAST_DEADLINES], wait=False)
    decode = start_node("decode", model_path, extra=["--page-size", "1", *FAST_DEADLINES], wait=False)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        req = requests("mismatch", 1)[3]
        with pytest.raises(grpc.RpcError) as err:
            run_pd(prefill, decode, req, room=12345, timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
        details = str(err.value.details())
        assert "page_size: prefill=16 decode=1" in details
        assert re.search(r"prefill dp 0 tp [01]/2: 1 of 2 KV heads x 32, 3 layers, page 16", details), details
        assert "decode dp 0 tp 0/1: 2 of 2 KV heads x 32, 3 layers, page 1," in details
        prefill.wait_pools_free()
        decode.wait_pools_free()
    finally:
        prefill.stop()
        decode.stop()


def test_eagle_tree_through_pd_with_tp_matches_colocated_tp1(model_path, colocated) -> None:
    """EAGLE3 (a tree) on a tp 2 prefill node (its head sharded, over the prompt) to a tp 1 and a tp 2 decode node:
    each head KV shard travels as one more layer (reassembled on tp 1), drafts run from the first decode step, and
    the tokens are the colocated tp 1 node's without speculation."""
    from tests.engine.test_eagle_head import head_dir

    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head_dir("EAGLE3")),
            "--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"]
    nodes = [start_node("prefill", model_path, extra=[*tp_args(2), *spec], wait=False),
             *(start_node("decode", model_path, extra=[*tp_args(tp), *spec], wait=False) for tp in (1, 2))]
    try:
        for node in nodes:
            node.wait_ready(timeout=240)
        reqs = requests("eagle-tp", 13)[1:5]
        for decode in nodes[1:]:
            rooms = random.Random(len(decode.log_path.name)).sample(range(1, 2**63), len(reqs))
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(functools.partial(run_pd, nodes[0], decode), reqs, rooms))
            for req, (got, fin, _) in zip(reqs, results, strict=True):
                assert got == reference(colocated, req), f"prompt of {len(req.input_ids)} tokens"
                assert fin.spec.draft_tokens > 0 and fin.spec.verify_steps > 0
        for node in nodes:
            node.wait_pools_free()
    finally:
        for node in nodes:
            node.stop()
