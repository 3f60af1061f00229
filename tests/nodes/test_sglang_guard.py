"""The SGLang HTTP worker port's guard (issue 34): SGLang's worker ``--api-key``, pre-auth connection bounds, a
client-named ``bootstrap_host`` accepted only from a prefill node that proves the cluster secret (checked before the
request reaches a rank: no slot, no KV Hello), and server info without local paths. The servicer is a recorder: what
reaches ``run_request`` is what would have taken a slot."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput
from common.engine.model.config import ModelConfig
from common.engine.sampling.params import SamplingParams
from common.node import front, http_guard
from common.node.conn_budget import PRE_AUTH_PER_PEER, PRE_AUTH_TOTAL
from common.node.sglang_http import SglangHttpServer
from kvtransfer.bootstrap import BootstrapClient, BootstrapServer, RankEntry

KEY = "sglang-worker-key-for-tests"


class _Ranks:
    max_total_tokens = 4096

    def alive(self) -> bool:
        return True

    def least_loaded_rank(self) -> int:
        return 0


class _Recorder:
    """A WorkerServicer whose requests are recorded and answered 503 (the gate is under test, not generation)."""

    draining = False
    grpc_port = 1
    check_rank = front.WorkerServicer.check_rank

    def __init__(self, args: ServerArgs, model_path: Path) -> None:
        self.args = args
        self.model_path = str(model_path)
        self.model_config = ModelConfig.from_path(str(model_path))
        self.ranks = _Ranks()
        self.requests: list[GenerateReqInput] = []

    async def run_request(self, msg: GenerateReqInput, rank: int, context: Any) -> AsyncIterator[Any]:
        self.requests.append(msg)
        raise front._Overloaded("recorded", 1.0)
        yield  # pragma: no cover  (an async generator)


async def _serve(model_path: Path, mode: str, api_key: str, monkeypatch: pytest.MonkeyPatch,
                 key_file: Path | None = None):
    """``api_key``: through the environment (PDCLUSTER_API_KEY); ``key_file``: through --api-key-file."""
    monkeypatch.delenv("PDCLUSTER_API_KEY_FILE", raising=False)
    if api_key:
        monkeypatch.setenv("PDCLUSTER_API_KEY", api_key)
    else:
        monkeypatch.delenv("PDCLUSTER_API_KEY", raising=False)
    args = ServerArgs(host="127.0.0.1", disaggregation_mode=mode, sglang_http_port=0,
                      api_key_file=str(key_file) if key_file is not None else None)
    rec = _Recorder(args, model_path)
    server = SglangHttpServer(args, rec)  # type: ignore[arg-type]
    await server.start()
    return server, rec


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_the_api_key_guards_every_path_but_health_and_server_info_names_no_local_path(
        model_path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "key").write_text(KEY + "\n")
    server, rec = await _serve(model_path, "null", "", monkeypatch, key_file=tmp_path / "key")
    base = f"http://127.0.0.1:{server.port}"
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    try:
        async with aiohttp.ClientSession() as s:
            for path in ("/health", "/health_generate"):
                async with s.get(base + path) as r:
                    assert r.status != 401
            for headers in ({}, _auth("a-guess")):
                async with s.post(base + "/generate", json=body, headers=headers) as r:
                    assert r.status == 401 and "--api-key" in (await r.json())["error"]["message"]
                async with s.get(base + "/get_server_info", headers=headers) as r:
                    assert r.status == 401
            assert rec.requests == []  # refused before the body was parsed or a rank was asked
            async with s.post(base + "/generate", json=body, headers=_auth(KEY)) as r:
                assert r.status == 503  # the recorder's answer: the request got through
            assert len(rec.requests) == 1
            for path in ("/get_server_info", "/get_model_info", "/v1/models"):
                async with s.get(base + path, headers=_auth(KEY)) as r:
                    assert r.status == 200
                    assert str(model_path) not in json.dumps(await r.json()), path
    finally:
        await server.stop()


async def test_without_a_key_the_port_stays_open(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server, rec = await _serve(model_path, "null", "", monkeypatch)
    try:
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{server.port}/generate",
                                                         json={"text": "hi"}) as r:
            assert r.status == 503 and len(rec.requests) == 1
    finally:
        await server.stop()


async def test_unauthenticated_connections_are_bounded_per_peer_and_closed_at_their_deadline(
        model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_guard, "HELLO_DEADLINE_S", 1.0)
    server, _rec = await _serve(model_path, "null", KEY, monkeypatch)
    held = []
    url = f"http://127.0.0.1:{server.port}/get_server_info"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url, headers=_auth(KEY)) as r:  # an authenticated keep-alive connection ...
                assert r.status == 200
            for _ in range(PRE_AUTH_PER_PEER + 3):
                held.append(await asyncio.open_connection("127.0.0.1", server.port))
            await asyncio.sleep(0.3)
            assert server.guard.budget.count == PRE_AUTH_PER_PEER and server.guard.budget.reclaimed == 3
            oldest = await asyncio.gather(*(asyncio.wait_for(r.read(), 0.5) for r, _ in held[:3]))
            assert oldest == [b""] * 3  # closed for the newest, long before the deadline
            async with s.get(url, headers=_auth(KEY)) as r:  # ... is not counted: it serves while the bound is full
                assert r.status == 200
            await asyncio.sleep(1.2)
            eofs = await asyncio.gather(*(asyncio.wait_for(r.read(), 2) for r, _ in held))
            assert eofs == [b""] * len(held)  # the silent ones lost their connection at the deadline
            assert server.guard.unauthenticated == 0 and server.guard.budget.count == 0
            async with s.get(url, headers=_auth(KEY)) as r:
                assert r.status == 200
    finally:
        for _, w in held:
            w.close()
        await server.stop()


async def test_a_flood_from_many_hosts_at_the_total_bound_leaves_a_keyed_client_served(
        model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 54's lock-out: twelve loopback addresses each holding their 32 unauthenticated connections fill the
    port's 256 slots; a client with the key still gets its answer at its first try, within a second."""
    server, _rec = await _serve(model_path, "null", KEY, monkeypatch)
    held: list[asyncio.StreamWriter] = []
    try:
        for host in range(2, 14):
            for _ in range(PRE_AUTH_PER_PEER):
                _r, w = await asyncio.open_connection("127.0.0.1", server.port, local_addr=(f"127.0.0.{host}", 0))
                held.append(w)
        await asyncio.sleep(0.2)
        assert server.guard.budget.count == PRE_AUTH_TOTAL
        async with aiohttp.ClientSession() as s:
            r = await asyncio.wait_for(s.get(f"http://127.0.0.1:{server.port}/get_server_info", headers=_auth(KEY)),
                                       1.0)
            assert r.status == 200
        assert server.guard.budget.reclaimed == len(held) + 1 - PRE_AUTH_TOTAL
    finally:
        for w in held:
            w.close()
        await server.stop()


def _bootstrap(secret: str) -> tuple[BootstrapServer, int]:
    server = BootstrapServer(secret=secret)
    port = server.start("127.0.0.1", 0)
    client = BootstrapClient(f"127.0.0.1:{port}")
    client.register(0, 0, 1, 1, RankEntry("tcp://127.0.0.1:1", "p0", 1), secret)
    client.close()
    return server, port


async def test_a_bootstrap_host_that_does_not_prove_the_cluster_secret_is_refused_before_any_slot(
        model_path: Path, cluster_token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    server, rec = await _serve(model_path, "decode", "", monkeypatch)
    foreign, foreign_port = await asyncio.to_thread(_bootstrap, "a-foreign-cluster-secret-of-enough-chars")
    ours, our_port = await asyncio.to_thread(_bootstrap, cluster_token)
    body = {"text": "hi", "bootstrap_room": 7, "bootstrap_host": "127.0.0.1", "sampling_params": {"max_new_tokens": 2}}
    try:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{server.port}/generate"
            for port in (foreign_port, foreign_port):  # refused again: a refusal is not cached as trust
                async with s.post(url, json={**body, "bootstrap_port": port, "disagg_prefill_dp_rank": 0}) as r:
                    assert r.status == 403, await r.text()
                    assert "did not prove" in (await r.json())["error"]["message"]
            assert rec.requests == []  # no slot taken, so no KV receiver, so no Hello to the named host
            async with s.post(url, json={**body, "bootstrap_port": our_port}) as r:
                assert r.status == 503
            assert [m.bootstrap_addr for m in rec.requests] == [f"127.0.0.1:{our_port}"]
    finally:
        await server.stop()
        foreign.stop()
        ours.stop()


class _SilentRanks(_Ranks):
    """Ranks that accept a request and never answer it (its deadline ends it)."""

    def __init__(self) -> None:
        self.waiters: dict[str, Any] = {}
        self.sent: list[Any] = []

    def register(self, rid: str, rank: int, put: Any) -> None:
        self.waiters[rid] = put

    def unregister(self, rid: str) -> None:
        self.waiters.pop(rid, None)

    def send(self, rank: int, msg: Any) -> None:
        self.sent.append(msg)


class _Deadline:
    """A gRPC context whose client deadline is ``seconds`` from now."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def time_remaining(self) -> float:
        return max(self.at - time.monotonic(), 0.0)

    def cancelled(self) -> bool:
        return False


async def test_a_deadline_error_names_the_deadline_the_request_had_not_the_time_left_at_the_end() -> None:
    ranks = _SilentRanks()
    servicer = front.WorkerServicer(ServerArgs(), "unused", None, ranks)  # type: ignore[arg-type]
    msg = GenerateReqInput(rid="slow", input_ids=[1, 2, 3], sampling_params=SamplingParams())
    with pytest.raises(front._Deadline, match=r"did not finish within 0\.3 s"):
        async for _ in servicer.run_request(msg, 0, _Deadline(0.3)):
            pass
    assert [type(m).__name__ for m in ranks.sent] == ["GenerateReqInput", "AbortReq"] and not ranks.waiters
