"""Request migration against mock workers: a leg that fails after producing tokens continues on another worker
from those tokens (``--max-migrations``); the client sees every token and character once."""

from __future__ import annotations

import grpc
import pytest

from common.testing.mock_requests import fake_tokens
from pdcluster.v1 import common_pb2, router_pb2
from router.testing import fleet
from tests.router.test_router_api import tokenizer

VOCAB = 1536


def ids_request(ids: list[int], n: int, stream: bool, rid: str, **sp: object) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        request_id=rid,
        input_ids=router_pb2.TokenIds(ids=ids),
        stream=stream,
        sampling_params=common_pb2.SamplingParams(max_new_tokens=n, **sp),  # type: ignore[arg-type]
    )


async def test_stream_continues_on_another_decode_worker_with_each_token_once() -> None:
    ids = [10, 11, 12, 13]
    async with fleet(prefill=1, decode=[{"die_after_tokens": 3}, {}], decode_policy="round_robin") as f:
        bad, good = f.decode
        stub = f.stub()
        req = ids_request(ids, 10, True, "m1", min_new_tokens=5)
        req.return_logprob = True
        msgs = [m async for m in stub.Generate(req)]
        chunks = [m.chunk for m in msgs if m.HasField("chunk")]
        done = msgs[-1].complete
        want = fake_tokens(ids, 10, VOCAB)
        assert [t for c in chunks for t in c.token_ids] == want == list(done.output_ids)
        assert "".join(c.text for c in chunks) == done.text == tokenizer().decode(want, skip_special_tokens=True)
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), 10)
        assert len(done.logprobs) == 10 and done.finish_reason == "length" and done.attempts == 2
        # The continuation: the prompt plus the 3 tokens so far, the remaining budget, marked as prior outputs.
        (cont,) = good.received("decode")
        assert cont["rid"] == "m1#1" and cont["input_ids"] == ids + want[:3]
        assert (cont["prior_output_len"], cont["max_new_tokens"], cont["min_new_tokens"]) == (3, 7, 2)
        assert [r["prior_output_len"] for r in bad.received("decode")] == [0]
        names = {a: w.name for a, w in f.server.service.core.registry.workers.items()}
        assert done.served_by.endswith(names[good.address])
        timing = f.server.service.core.timings.get("m1")
        assert timing is not None and timing["migrations"] == 1
        (mig,) = timing["migrated"]
        assert (mig["after_tokens"], mig["failed"], mig["leg"], mig["code"]) == (
            3, names[bad.address], "decode", "UNAVAILABLE")
        metrics = f.server.service.metrics.render().decode()
        assert 'pdcluster_router_migrations_total{leg="decode"} 1.0' in metrics


async def test_non_streaming_request_migrates_and_a_bad_request_never_does() -> None:
    ids = [20, 21, 22]
    async with fleet(colocated=[{"die_after_tokens": 2}, {}], prefill=0, decode=0,
                     prefill_policy="round_robin") as f:
        stub = f.stub()
        (msg,) = [m async for m in stub.Generate(ids_request(ids, 8, False, "n1"))]
        done = msg.complete
        assert list(done.output_ids) == fake_tokens(ids, 8, VOCAB) and done.usage.completion_tokens == 8
        assert done.attempts == 2
        assert [r["prior_output_len"] for w in f.colocated for r in w.received("generate")] == [0, 2]
        metrics = f.server.service.metrics.render().decode()
        assert 'pdcluster_router_migrations_total{leg="generate"} 1.0' in metrics

    async with fleet(prefill=1, decode=[{"die_after_tokens": 2, "die_code": grpc.StatusCode.INVALID_ARGUMENT}, {}],
                     decode_policy="round_robin") as f:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in f.stub().Generate(ids_request(ids, 8, False, "n2")):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert sum(len(w.received("decode")) for w in f.decode) == 1


async def test_stop_string_spanning_the_migration_boundary_stops_the_request() -> None:
    tok = tokenizer()
    ids = tok.encode("The cat")
    out = fake_tokens(ids, 10, VOCAB)
    full, before = tok.decode(out, skip_special_tokens=True), tok.decode(out[:3], skip_special_tokens=True)
    cut = len(before) - 2
    stop = full[cut : len(before) + 2]  # two characters of the first attempt's, two of the second's
    assert full.startswith(before) and full.find(stop) == cut and "\ufffd" not in full[: cut + len(stop)]
    async with fleet(prefill=1, decode=[{"die_after_tokens": 3}, {}], decode_policy="round_robin") as f:
        msgs = [m async for m in f.stub().Generate(ids_request(ids, 10, True, "s1", stop=[stop]))]
        done = msgs[-1].complete
        streamed = "".join(m.chunk.text for m in msgs if m.HasField("chunk"))
        assert streamed == done.text == full[:cut]
        assert done.finish_reason == "stop" and done.matched_stop == stop and done.attempts == 2
        assert len(f.decode[1].received("decode")) == 1


async def test_exhausted_migrations_fail_clearly_after_the_tokens_streamed() -> None:
    ids = [30, 31, 32]
    async with fleet(prefill=1, decode=[{"die_after_tokens": 2}, {"die_after_tokens": 2}], max_migrations=1) as f:
        got: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for m in f.stub().Generate(ids_request(ids, 20, True, "x1")):
                got += m.chunk.token_ids
                assert not m.HasField("complete")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "--max-migrations" in e.value.details() and "4 output tokens" in e.value.details()
        assert got == fake_tokens(ids, 4, VOCAB)  # each token once, across both attempts
        assert sum(len(w.received("decode")) for w in f.decode) == 2


async def test_a_leg_lost_after_its_last_token_ends_the_request_without_another_attempt() -> None:
    ids = [40, 41, 42]
    async with fleet(prefill=1, decode=[{"die_before_finished": True}]) as f:
        for stream in (True, False):
            msgs = [m async for m in f.stub().Generate(ids_request(ids, 5, stream, f"e{stream}"))]
            done = msgs[-1].complete
            assert list(done.output_ids) == fake_tokens(ids, 5, VOCAB) and done.finish_reason == "length"
            if stream:
                assert "".join(m.chunk.text for m in msgs[:-1]) == done.text
            assert done.text == tokenizer().decode(done.output_ids, skip_special_tokens=True)
        assert len(f.decode[0].received("decode")) == 2  # one attempt per request
