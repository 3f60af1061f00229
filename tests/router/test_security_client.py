"""The client surface: the API key (HTTP and gRPC), TLS on the router's listeners, mutual TLS from the router to the
nodes (real certificates generated here), start-up errors for bad TLS files, and client errors that name no internal
address or path."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import aiohttp
import grpc
import httpx2 as httpx  # the HTTP client of this openai release
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.app.cli import main
from common.env import ClientKey
from common.errors import ConfigError
from common.testing.mock_fleet import shared_model_dir
from common.tls import TlsFiles
from common.wire.mux_socket import connect
from common.wire.worker_auth import worker_credential
from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.admin import bearer_metadata
from router.config import RouterConfig, WorkerSpec
from router.server import RouterServer
from router.testing import FAST, eventually, fleet
from tests.tls_helpers import TestCa

API_KEY = "client-api-key-0123456789abcdef"
KEYS = (ClientKey(API_KEY),)
BODY = {"model": "mock-model", "prompt": "hi", "max_tokens": 2}


def gen(n: int = 2) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(text="Hello", sampling_params=common_pb2.SamplingParams(max_new_tokens=n))


async def generate(stub: router_pb2_grpc.RouterStub, timeout: float = 10, **kw: object
                   ) -> list[router_pb2.RouterGenerateResponse]:
    return [m async for m in stub.Generate(gen(), timeout=timeout, **kw)]


async def test_api_key_guards_http_generation_and_models_but_not_probes() -> None:
    async with fleet(prefill=1, decode=1, api_keys=KEYS) as f, aiohttp.ClientSession() as http:
        url = f.server.http_url
        for headers, why in (({}, "missing API key"), ({"Authorization": "Bearer wrong-key"}, "incorrect API key"),
                             ({"Authorization": API_KEY}, "incorrect API key")):
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
                async with http.request(method, url + path, json=BODY, headers=headers) as r:
                    assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer", (path, headers)
                    error = (await r.json())["error"]
                    assert error["code"] == "invalid_api_key" and why in error["message"]
        assert all(not w.records for w in f.workers)  # nothing reached a node
        for path in ("/health", "/liveness"):
            async with http.get(url + path) as r:
                assert r.status == 200, path
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0) as client:
            r = await client.completions.create(**BODY)
            assert r.usage.completion_tokens == 2
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="not-the-key", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.completions.create(**BODY)


async def test_api_key_guards_grpc_generation_and_leaves_health_and_admin_apart() -> None:
    async with (fleet(prefill=1, decode=1, api_keys=KEYS) as f,
                grpc.aio.insecure_channel(f.server.grpc_address) as channel):
        stub = router_pb2_grpc.RouterStub(channel)
        for metadata in ((), bearer_metadata("wrong-key"), (("authorization", API_KEY),)):
            for call in (lambda md: generate(stub, metadata=md),
                         lambda md: stub.ListModels(router_pb2.ListModelsRequest(), metadata=md)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(metadata)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
        # An unauthenticated request is refused before it is parsed (garbage gets no INVALID_ARGUMENT hint).
        raw = channel.unary_stream("/pdcluster.v1.Router/Generate")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in raw(b"\xff\xff\xff"):
                pass
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert all(not w.records for w in f.workers)
        msgs = await generate(stub, metadata=bearer_metadata(API_KEY))
        assert msgs[-1].complete.usage.completion_tokens == 2
        models = await stub.ListModels(router_pb2.ListModelsRequest(), metadata=bearer_metadata(API_KEY))
        assert list(models.models) == ["mock-model"]
        # The API key does not open the admin surface; health stays open for probes.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ListWorkers(router_pb2.ListWorkersRequest(), metadata=bearer_metadata(API_KEY))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_api_key_comes_from_a_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from router.cli import add_router_args, config_from_args

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    key_file = tmp_path / "api-key"
    key_file.write_text(API_KEY + "\n")
    assert config_from_args(parser.parse_args(["--api-key-file", str(key_file)])).api_keys == KEYS
    assert API_KEY not in repr(config_from_args(parser.parse_args(["--api-key", API_KEY])))
    monkeypatch.setenv("PDCLUSTER_API_KEY_FILE", str(key_file))
    assert config_from_args(parser.parse_args([])).api_keys == KEYS
    monkeypatch.delenv("PDCLUSTER_API_KEY_FILE")
    assert config_from_args(parser.parse_args([])).api_keys == ()  # no key: the client surface is open
    assert main(["router", "--api-key-file", str(tmp_path / "absent")]) == 2
    assert "--api-key-file" in capsys.readouterr().err


def test_a_key_file_lists_keys_with_their_priority_ceilings_and_a_bad_line_names_no_key(tmp_path: Path) -> None:
    from common.env import read_key_file, read_secret_file

    path = tmp_path / "keys"
    path.write_text("# ordinary clients\nsk-first\n\n  sk-batch   max_priority=-10\nsk-oncall max_priority=100\n")
    assert read_key_file(str(path), "--api-key-file") == (
        ClientKey("sk-first"), ClientKey("sk-batch", -10), ClientKey("sk-oncall", 100))
    assert read_secret_file(str(path), "--api-key-file") == "sk-first"  # what a node's SGLang HTTP port takes
    for text, why in (("sk-a max_priority=high\n", "line 1: expected"), ("sk-a\nsk-b priority=3\n", "line 2"),
                      (f"sk-a max_priority={2**31}\n", "line 1"), ("# none\n", "holds no key"),
                      ("sk-a\nsk-a max_priority=1\n", "listed twice")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=why) as e:
            read_key_file(str(path), "--api-key-file")
        assert "sk-a" not in str(e.value)


async def test_tls_listeners_serve_https_and_grpc_and_refuse_plaintext(tmp_path: Path) -> None:
    ca = TestCa(tmp_path)
    async with fleet(prefill=1, decode=1, tls=ca.files("router", mutual=False)) as f:
        url = f.server.http_url
        assert url.startswith("https://")
        async with (httpx.AsyncClient(verify=ssl.create_default_context(cafile=ca.ca)) as http_client,
                    openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                       http_client=http_client) as client):
            r = await client.completions.create(**BODY)
            assert r.usage.completion_tokens == 2
        creds = grpc.ssl_channel_credentials(root_certificates=Path(ca.ca).read_bytes())
        async with grpc.aio.secure_channel(f.server.grpc_address, creds) as channel:
            msgs = await generate(router_pb2_grpc.RouterStub(channel))
            assert msgs[-1].complete.usage.completion_tokens == 2
        # Plaintext clients, and clients that do not trust the certificate, get nothing.
        async with grpc.aio.insecure_channel(f.server.grpc_address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(router_pb2_grpc.RouterStub(channel), timeout=3)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientError):
                async with http.post(url.replace("https://", "http://") + "/v1/completions", json=BODY) as r:
                    await r.read()
        async with httpx.AsyncClient() as untrusting:
            with pytest.raises(httpx.ConnectError):
                await untrusting.get(url + "/v1/models")
        assert len(f.decode[0].received("decode")) == 2


async def test_mtls_router_reaches_nodes_and_nodes_refuse_callers_without_a_ca_signed_cert(tmp_path: Path) -> None:
    ca = TestCa(tmp_path / "ca")
    router_tls = ca.files("router")
    async with fleet(prefill=1, decode=1, common={"tls": ca.files("node")}, tls=router_tls) as f:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(ca.ca).read_bytes())
        async with grpc.aio.secure_channel(f.server.grpc_address, creds) as channel:
            msgs = await generate(router_pb2_grpc.RouterStub(channel))
        assert msgs[-1].complete.usage.completion_tokens == 2
        assert len(f.prefill[0].received("prefill")) == 1
        for w in f.workers:  # the legs went over each node's Mux socket, under the same mTLS
            stream = f.server.service.registry.workers[w.address].mux.stream
            assert stream is not None and stream.transport == "socket"

        rogue = TestCa(tmp_path / "rogue", "rogue CA").issue("rogue")
        verify_only = ssl.create_default_context(cafile=ca.ca)
        rogue_ctx = ssl.create_default_context(cafile=ca.ca)
        rogue_ctx.load_cert_chain(rogue.cert, rogue.key)
        for who, ctx in {"plaintext": None, "TLS without a client certificate": verify_only,
                         "a certificate of another CA": rogue_ctx}.items():
            with pytest.raises((ConnectionError, ssl.SSLError, TimeoutError)):
                conn = await connect("127.0.0.1", f.decode[0].mux_socket_port, worker_credential(), ctx,
                                     "127.0.0.1", timeout=3)
                conn.close()
                pytest.fail(f"{who}: the Mux socket served a caller without a CA-signed certificate")
        callers = {
            "plaintext": None,
            "TLS without a client certificate": grpc.ssl_channel_credentials(Path(ca.ca).read_bytes()),
            "a certificate of another CA": grpc.ssl_channel_credentials(
                Path(ca.ca).read_bytes(), rogue.key.read_bytes(), rogue.cert.read_bytes()),
        }
        for who, caller in callers.items():
            address = f.decode[0].address
            channel = (grpc.aio.secure_channel(address, caller) if caller is not None
                       else grpc.aio.insecure_channel(address))
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, who

        # A router without the CA's client certificate never gets the nodes healthy; its error names no address.
        plain = RouterServer(RouterConfig(model_path=str(shared_model_dir()), grpc_port=0, http_port=None,
                                          workers=tuple(WorkerSpec(w.address, w.cfg.role) for w in f.workers),
                                          **FAST))
        await plain.start()
        try:
            async with grpc.aio.insecure_channel(plain.grpc_address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await generate(router_pb2_grpc.RouterStub(channel))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no routable" in e.value.details() and "127.0.0.1" not in e.value.details()
            # start() probed every node once: GetServerInfo over plaintext never got an answer
            assert all(w.info is None and not w.healthy for w in plain.service.registry)
        finally:
            await plain.stop(0)
        assert len(f.prefill[0].received("prefill")) == 1


async def test_tls_server_name_lets_nodes_carry_one_dns_name(tmp_path: Path) -> None:
    ca = TestCa(tmp_path)
    nodes = {"tls": ca.files("node", names=("pd-node.internal",))}  # not valid for 127.0.0.1, the address dialled
    async with fleet(prefill=1, decode=1, common=nodes, tls=ca.files("router"),
                     tls_server_name="pd-node.internal") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(ca.ca).read_bytes())
        async with grpc.aio.secure_channel(f.server.grpc_address, creds) as channel:
            msgs = await generate(router_pb2_grpc.RouterStub(channel))
        assert msgs[-1].complete.usage.completion_tokens == 2
        for w in f.workers:  # the Mux sockets checked the same name
            stream = f.server.service.registry.workers[w.address].mux.stream
            assert stream is not None and stream.transport == "socket"
    with pytest.raises(ConfigError, match="--tls-server-name"):
        RouterConfig(tls=ca.files("router", mutual=False), tls_server_name="pd-node.internal")


@pytest.mark.parametrize("breakage", ["missing cert", "key of another cert", "not PEM", "ca without cert"])
def test_bad_tls_files_stop_router_and_node_at_start_up(tmp_path: Path, breakage: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    ca = TestCa(tmp_path)
    a, b = ca.issue("a"), ca.issue("b")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    flags = {
        "missing cert": ["--tls-cert", str(tmp_path / "absent.crt"), "--tls-key", str(a.key)],
        "key of another cert": ["--tls-cert", str(a.cert), "--tls-key", str(b.key)],
        "not PEM": ["--tls-cert", str(junk), "--tls-key", str(a.key)],
        "ca without cert": ["--tls-ca", ca.ca],
    }[breakage]
    with pytest.raises(ConfigError, match="--tls-"):
        TlsFiles(*(dict(zip(flags[::2], flags[1::2], strict=True)).get(f) for f in ("--tls-cert", "--tls-key",
                                                                                       "--tls-ca"))).check()
    for command in ("router", "serve"):
        assert main([command, *flags]) == 2
        err = capsys.readouterr().err
        assert f"pdcluster {command}: error: --tls-" in err, err


async def test_client_errors_name_no_internal_address_or_path(caplog: pytest.LogCaptureFixture) -> None:
    leak = ("transfer to 10.1.2.3:8998 failed; see /var/lib/pdcluster/run-7/decode.log "
            "(peer decode-0.pd.svc:30001, ipv6 [fd00::7]:9000)")
    secrets = ("10.1.2.3", "/var/lib", "decode-0", "fd00", "127.0.0.1")
    prefill = {"fail_prefill": -1, "fail_message": leak, "fail_code": grpc.StatusCode.INVALID_ARGUMENT}
    async with fleet(prefill=[prefill], decode=1) as f, aiohttp.ClientSession() as http:
        # A node's rejection is relayed: still which leg and why, without the node's addresses and paths.
        async with http.post(f.server.http_url + "/v1/completions", json=BODY) as r:
            assert r.status == 400
            message = (await r.json())["error"]["message"]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(f.stub())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for text in (message, e.value.details()):
            assert "Prefill on a prefill worker failed: INVALID_ARGUMENT: transfer to <internal address>" in text
            assert "see <path>" in text and not any(s in text for s in secrets), text

        # Out-of-range numbers are the router's to refuse, naming the field, before a node sees them.
        seen = len(f.prefill[0].records)
        huge = router_pb2.RouterGenerateRequest(text="Hello", sampling_params=common_pb2.SamplingParams(
            max_new_tokens=2, temperature=1e308))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in f.stub().Generate(huge, timeout=10):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.value.details()
        assert "worker" not in e.value.details() and len(f.prefill[0].records) == seen

        # Unreachable workers: grpc's own "ipv4:127.0.0.1:port: Failed to connect" never reaches the client.
        caplog.set_level(logging.INFO, logger="router")
        for w in f.prefill:
            await w.stop()
        ports = [str(w.port) for w in f.workers]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(f.stub())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        await eventually(lambda: not any(w.healthy for w in f.server.service.registry if w.role == "prefill"))
        async with http.post(f.server.http_url + "/v1/completions", json=BODY) as r:
            assert r.status == 503
            message = (await r.json())["error"]["message"]
        assert "no routable prefill worker (1 registered: 1 unhealthy)" in message
        for text in (message, e.value.details()):
            assert not any(s in text for s in secrets) and not any(p in text for p in ports), text
        # Operators keep the details: the router's log names the worker.
        assert f.prefill[0].address in caplog.text
