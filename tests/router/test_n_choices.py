"""``n > 1`` on the OpenAI surface (router/choices.py), over the mock fleet: one request per choice (rid
``<rid>-<i>``, seed + i), every choice in the body or the stream under its own index, usage over all choices."""

from __future__ import annotations

import aiohttp
import msgspec

from common.engine.sampling.params import SamplingParams
from router.choices import choice_request
from router.request import GenRequest, sampling_to_proto
from router.testing import fleet


def _gen(seed: int | None) -> GenRequest:
    sp = SamplingParams(max_new_tokens=4, seed=seed)
    return GenRequest(rid="r", api="completions", input_ids=[1, 2], sampling=sp, sampling_pb=sampling_to_proto(sp),
                      stream=False, arrival=0.0, deadline=1.0)


def test_choice_requests_have_their_own_rid_and_seed() -> None:
    c = [choice_request(_gen(7), i) for i in range(3)]
    assert [x.rid for x in c] == ["r-0", "r-1", "r-2"]
    assert [x.sampling.seed for x in c] == [7, 8, 9] == [x.sampling_pb.seed for x in c]
    top = choice_request(_gen(2**63 - 1), 1)  # wraps within a signed 64-bit seed
    assert top.sampling.seed == -(2**63)
    top.sampling.verify(100)
    unseeded = choice_request(_gen(None), 2)
    assert unseeded.sampling.seed is None and not unseeded.sampling_pb.HasField("seed")


async def test_n_choices_full_body_and_stream() -> None:
    async with fleet(prefill=0, decode=0, colocated=1) as f, aiohttp.ClientSession() as http:
        url = f.server.http_url
        body = {"model": "mock-model", "prompt": "hello", "max_tokens": 5, "n": 3, "seed": 11}
        async with http.post(url + "/v1/completions", json=body, headers={"X-Request-ID": "nreq"}) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert all(c["finish_reason"] == "length" and c["text"] for c in out["choices"])
        assert out["usage"]["completion_tokens"] == 15 and out["usage"]["prompt_tokens"] < 15
        assert len(out["pdcluster"]["choices"]) == 3
        got = sorted((r["rid"], r["seed"]) for r in f.colocated[0].received("generate"))
        assert got == [("nreq-0", 11), ("nreq-1", 12), ("nreq-2", 13)]

        chat = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
                "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200, await r.text()
            raw = (await r.read()).decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [msgspec.json.decode(e) for e in events[:-1]]
        usage = [c for c in chunks if not c["choices"]]
        assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 8
        per: dict[int, list[dict]] = {0: [], 1: []}
        for c in chunks:
            for ch in c["choices"]:
                per[ch["index"]].append(ch)
        for i in (0, 1):
            assert per[i][0]["delta"].get("role") == "assistant"
            assert [ch["finish_reason"] for ch in per[i]].count("length") == 1 and per[i][-1]["finish_reason"]
            assert "".join(ch["delta"].get("content") or "" for ch in per[i])
        for w in f.workers:
            assert not w.active


async def test_n_choices_on_grpc() -> None:
    """``n`` on ``pdcluster.v1.Router/Generate``: one request per choice (own rid, seed + i), chunks and one Complete
    per choice tagged with its index; n outside [1, --max-n] is INVALID_ARGUMENT naming the field."""
    import grpc
    import pytest

    from pdcluster.v1 import common_pb2, router_pb2

    async with fleet(prefill=0, decode=0, colocated=1) as f:
        stub = f.stub()
        req = router_pb2.RouterGenerateRequest(
            request_id="g", input_ids=router_pb2.TokenIds(ids=[4, 5, 6]), stream=True, n=3,
            sampling_params=common_pb2.SamplingParams(max_new_tokens=4, seed=20),
        )
        msgs = [m async for m in stub.Generate(req)]
        done = sorted((m.complete for m in msgs if m.HasField("complete")), key=lambda c: c.index)
        assert [(c.index, c.request_id, c.finish_reason) for c in done] == [
            (0, "g-0", "length"), (1, "g-1", "length"), (2, "g-2", "length")]
        for c in done:  # each choice's chunks add up to its own Complete
            chunks = [m.chunk for m in msgs if m.HasField("chunk") and m.chunk.index == c.index]
            assert [t for ch in chunks for t in ch.token_ids] == list(c.output_ids) and len(c.output_ids) == 4
        got = sorted((r["rid"], r["seed"]) for r in f.colocated[0].received("generate"))
        assert got == [("g-0", 20), ("g-1", 21), ("g-2", 22)]

        one = [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(
            input_ids=router_pb2.TokenIds(ids=[4, 5]), sampling_params=common_pb2.SamplingParams(max_new_tokens=2)))]
        assert len(one) == 1 and one[0].complete.index == 0  # unset n: one choice, as before
        for bad in (0, 9):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(router_pb2.RouterGenerateRequest(
                    input_ids=router_pb2.TokenIds(ids=[4]), n=bad))]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be between 1 and 8" in (
                err.value.details() or "")
        for w in f.workers:
            assert not w.active


async def test_n_choices_go_to_one_prefill_and_one_decode_rank() -> None:
    """The choices of one P/D request share their workers and DP ranks (``RoutePin``): the prefill node computes the
    prompt once and the decode node holds its pages once, though the policies alone would spread them."""
    async with fleet(prefill=2, decode=2, common={"dp_size": 2}, prefill_policy="round_robin",
                     decode_policy="round_robin") as f, aiohttp.ClientSession() as http:
        body = {"model": "mock-model", "prompt": "hello there", "max_tokens": 3, "n": 4, "seed": 5}
        for rid in ("pin-a", "pin-b"):
            async with http.post(f.server.http_url + "/v1/completions", json=body,
                                 headers={"X-Request-ID": rid}) as r:
                assert r.status == 200, await r.text()
        for group in (f.prefill, f.decode):
            where = {}
            for i, w in enumerate(group):
                for rec in w.received("prefill" if group is f.prefill else "decode"):
                    where.setdefault(rec["rid"].rsplit("-", 1)[0], set()).add((i, rec["rank"]))
            assert sorted(where) == ["pin-a", "pin-b"], where
            assert all(len(places) == 1 for places in where.values()), where


async def test_n_choices_go_to_one_colocated_rank() -> None:
    """Without a P/D pair the choices share one colocated worker and DP rank (``RoutePin`` with one pick), though the
    policy alone would spread them."""
    async with fleet(prefill=0, decode=0, colocated=2, common={"dp_size": 2}, prefill_policy="round_robin") as f, \
            aiohttp.ClientSession() as http:
        body = {"model": "mock-model", "prompt": "hello there", "max_tokens": 3, "n": 4, "seed": 5}
        async with http.post(f.server.http_url + "/v1/completions", json=body, headers={"X-Request-ID": "pin-c"}) as r:
            assert r.status == 200, await r.text()
        places = {(i, rec["rank"]) for i, w in enumerate(f.colocated) for rec in w.received("generate")}
        assert len(places) == 1, places
        assert sum(len(w.received("generate")) for w in f.colocated) == 4
