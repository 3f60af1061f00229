"""Clients that send one ``RequestSpec`` and time it: the router's OpenAI API (official ``openai`` async client,
streaming SSE) or its gRPC API (``pdcluster.v1.Router/Generate``). Both return a ``RequestResult`` and never raise
for a failed request: the error kind goes into the result."""

from __future__ import annotations

import time
from typing import Any, Protocol

from benchmarks.loadgen.stats import RequestResult, spread_chunk
from benchmarks.loadgen.workload import RequestSpec


class Client(Protocol):
    async def send(self, spec: RequestSpec, t0: float) -> RequestResult:
        """Send ``spec``; times in the result are relative to ``t0`` (``time.perf_counter``)."""
        ...

    async def close(self) -> None: ...


def _error_kind(e: BaseException) -> str:
    import grpc
    import openai

    if isinstance(e, openai.APIStatusError):
        return f"http_{e.status_code}"
    if isinstance(e, openai.APITimeoutError | TimeoutError):
        return "timeout"
    if isinstance(e, openai.APIConnectionError):
        return "connection"
    if isinstance(e, grpc.aio.AioRpcError):
        return f"grpc_{e.code().name}"
    return type(e).__name__


class OpenAIClient:
    """``/v1/completions`` (token-id prompts) and ``/v1/chat/completions`` (specs with messages)."""

    def __init__(self, base_url: str, model: str = "", timeout_s: float = 300.0, stream: bool = True,
                 api_key: str = "", tls_ca: str | None = None) -> None:
        """``api_key``: the router's ``--api-key`` (sent as ``Authorization: Bearer``); ``tls_ca``: the CA bundle
        that signed an https router's certificate (default: the system's)."""
        import openai

        self.model = model
        self.stream = stream
        http_client = None
        if tls_ca is not None:
            import ssl

            http_client = openai.DefaultAsyncHttpxClient(verify=ssl.create_default_context(cafile=tls_ca),
                                                         timeout=timeout_s)
        # the client's default pool holds 1000 connections: enough for any concurrency this machine can drive
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0,
                                         timeout=timeout_s, http_client=http_client)

    async def resolve_model(self) -> str:
        if not self.model:
            self.model = (await self.client.models.list()).data[0].id
        return self.model

    async def close(self) -> None:
        await self.client.close()

    async def send(self, spec: RequestSpec, t0: float) -> RequestResult:
        r = RequestResult(spec.index, spec.kind, time.perf_counter() - t0, prompt_tokens=spec.prompt_len)
        sent = time.perf_counter()
        extra: dict[str, Any] = {"ignore_eos": True}
        if spec.priority is not None:
            extra["priority"] = spec.priority
        common: dict[str, Any] = {"model": self.model, "max_tokens": spec.max_tokens, "temperature": 0.0,
                                  "extra_body": extra}
        try:
            if self.stream:
                common["stream"] = True
                common["stream_options"] = {"include_usage": True}
            if spec.messages is not None:
                resp = await self.client.chat.completions.create(messages=spec.messages, **common)  # type: ignore[arg-type]
            else:
                resp = await self.client.completions.create(prompt=spec.prompt_ids, **common)
            if not self.stream:
                now = time.perf_counter()
                r.ttft = r.e2e = now - sent
                r.token_times.append(now - t0)
                self._finish(r, resp)
                return r
            async for chunk in resp:  # type: ignore[union-attr]
                now = time.perf_counter()
                if chunk.choices:
                    c = chunk.choices[0]
                    text = c.delta.content if spec.messages is not None else c.text  # type: ignore[union-attr]
                    if text:
                        if r.ttft is None:
                            r.ttft = now - sent
                        r.token_times.append(now - t0)
                self._finish(r, chunk)
            r.e2e = time.perf_counter() - sent
        except Exception as e:
            r.error = _error_kind(e)
            return r
        r.ok = r.error is None
        return r

    @staticmethod
    def _finish(r: RequestResult, obj: Any) -> None:
        usage = getattr(obj, "usage", None)
        if usage is not None:
            r.output_tokens = usage.completion_tokens
            r.prompt_tokens = usage.prompt_tokens
            r.ok = True
        ext = (getattr(obj, "model_extra", None) or {}).get("pdcluster")
        if ext:
            r.server_timing = ext.get("timing")


class GrpcClient:
    """``pdcluster.v1.Router/Generate`` with token-id input (chat specs send messages), streamed."""

    def __init__(self, address: str, timeout_s: float = 300.0, stream: bool = True, api_key: str = "",
                 tls_ca: str | None = None) -> None:
        """``api_key``: sent as ``authorization: Bearer`` metadata; ``tls_ca``: a TLS router's CA bundle."""
        import grpc

        from pdcluster.v1 import router_pb2_grpc

        if tls_ca is not None:
            from pathlib import Path

            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self.channel = grpc.aio.secure_channel(address, creds)
        else:
            self.channel = grpc.aio.insecure_channel(address)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.timeout_s = timeout_s
        self.stream = stream

    async def close(self) -> None:
        await self.channel.close()

    async def send(self, spec: RequestSpec, t0: float) -> RequestResult:
        from google.protobuf.json_format import MessageToDict

        from pdcluster.v1 import common_pb2, router_pb2

        r = RequestResult(spec.index, spec.kind, time.perf_counter() - t0, prompt_tokens=spec.prompt_len)
        sp = common_pb2.SamplingParams(max_new_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
        req = router_pb2.RouterGenerateRequest(sampling_params=sp, stream=self.stream, priority=spec.priority)
        if spec.messages is not None:
            req.messages.messages.extend(router_pb2.ChatMessage(**m) for m in spec.messages)
        else:
            req.input_ids.ids.extend(spec.prompt_ids)
        sent = time.perf_counter()
        try:
            async for m in self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata):
                now = time.perf_counter()
                ids = m.chunk.token_ids if m.HasField("chunk") else m.complete.output_ids
                if m.HasField("complete") and self.stream:
                    ids = []
                if ids:
                    if r.ttft is None:
                        r.ttft = now - sent
                    spread_chunk(r.token_times, now - t0, len(ids))
                if m.HasField("complete"):
                    c = m.complete
                    r.output_tokens, r.prompt_tokens = c.usage.completion_tokens, c.usage.prompt_tokens
                    r.server_timing = MessageToDict(c.timing, preserving_proto_field_name=True)
                    r.ok = True
            r.e2e = time.perf_counter() - sent
        except Exception as e:
            r.ok, r.error = False, _error_kind(e)
        if r.ok and r.ttft is None:
            r.ttft = r.e2e
        return r
