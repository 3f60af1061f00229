"""Request migration on a real cluster (1 prefill + 2 decode nodes, tcp, behind an in-process router): a decode
node SIGKILLed mid-stream loses the client nothing. The stream continues on the other decode node token-identical
to an uninterrupted greedy run, each token once; and P + D continue a seeded, penalised request from ``k`` outputs
exactly as the uninterrupted run (``prior_output_len``: P draws step ``k``, D the steps after it)."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from router.config import RouterConfig, WorkerSpec
from router.server import RouterServer
from tests.node_helpers import Node, start_node
from tests.nodes.test_nodes import FAST_DEADLINES, run_pd

pytestmark = pytest.mark.slow

PROMPT = list(range(10, 50))
N = 400  # enough tokens that the stream is still running when its decode node dies


def seeded_request(rid: str, ids: list[int], n: int, min_new: int, prior: int) -> worker_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(max_new_tokens=n, min_new_tokens=min_new, temperature=1.0, seed=99,
                                   repetition_penalty=1.3, frequency_penalty=1.0, presence_penalty=1.5)
    return worker_pb2.GenerateRequest(rid=rid, input_ids=ids, sampling_params=sp, return_logprob=True,
                                      prior_output_len=prior)


def greedy(rid: str) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        request_id=rid, input_ids=router_pb2.TokenIds(ids=PROMPT), stream=True, return_logprob=True,
        sampling_params=common_pb2.SamplingParams(max_new_tokens=N, temperature=0, ignore_eos=True),
    )


def running(node: Node) -> int:
    return sum(r.running + r.transfer + r.prealloc for r in node.load().ranks)


async def test_decode_killed_mid_stream_migrates_token_identical(model_path) -> None:
    nodes = [start_node(m, model_path, extra=FAST_DEADLINES, wait=False) for m in ("prefill", "decode", "decode")]
    server: RouterServer | None = None
    try:
        for n in nodes:
            n.wait_ready()
        p, d1, d2 = nodes

        # P + D continue a seeded request from k outputs as if uninterrupted.
        full, _, _ = run_pd(p, d1, seeded_request("s", PROMPT, 24, 14, 0), room=1)
        assert len(full) > 12
        k = 7
        rest, _, _ = run_pd(p, d2, seeded_request("s#1", PROMPT + full[:k], 24 - k, 14 - k, k), room=2)
        assert rest == full[k:]

        server = RouterServer(RouterConfig(
            model_path=str(model_path), grpc_port=0, http_port=None, health_interval_s=0.5, load_interval_s=0.2,
            request_timeout_s=120.0,
            workers=(WorkerSpec(p.addr, "prefill", p.bootstrap_port), WorkerSpec(d1.addr, "decode"),
                     WorkerSpec(d2.addr, "decode")),
        ))
        await server.start()
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            base = [m async for m in stub.Generate(greedy("base"))]
            want = [t for m in base[:-1] for t in m.chunk.token_ids]
            assert want == list(base[-1].complete.output_ids) and len(want) == N

            got: list[int] = []
            text: list[str] = []
            logprobs: list[float] = []
            victim: Node | None = None
            done = None
            async for m in stub.Generate(greedy("victim")):
                if m.HasField("complete"):
                    done = m.complete
                    break
                got += m.chunk.token_ids
                text.append(m.chunk.text)
                logprobs += m.chunk.logprobs
                if victim is None and len(got) >= 8:
                    victim = next(d for d in (d1, d2) if running(d))
                    victim.kill()  # SIGKILL by its PID
                    killed_after, killed_at = len(got), time.monotonic()
            assert victim is not None and done is not None
            assert got == want == list(done.output_ids)  # token-identical, no duplicate or missing token
            assert "".join(text) == done.text == base[-1].complete.text
            assert logprobs == pytest.approx(list(base[-1].complete.logprobs), abs=1e-3)
            assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(PROMPT), N)
            survivor = d2 if victim is d1 else d1
            names = {a: w.name for a, w in server.service.registry.workers.items()}
            assert done.served_by.endswith(names[survivor.addr]) and done.attempts == 2
            timing = server.service.pipeline.timings.get("victim")
            assert timing is not None and timing["migrations"] == 1
            (mig,) = timing["migrated"]
            assert mig["failed"] == names[victim.addr] and mig["leg"] == "decode"
            assert killed_after <= mig["after_tokens"] < N, "the kill came after the request had finished"
            assert time.monotonic() - killed_at < 60
        for n in (p, survivor):
            n.wait_pools_free()
    finally:
        if server is not None:
            await server.stop(0)
        for n in nodes:  # NOTE: all drain at once; ``stop`` then waits for each
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGTERM)
        for n in nodes:
            n.stop()
