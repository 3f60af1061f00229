"""``--sglang-http-port``: SGLang's HTTP worker API on a node, so the node serves behind sglang-router (PD mode).

sglang-router sends one body to the prefill and the decode node of a pair at once, with ``bootstrap_host`` /
``bootstrap_port`` (the port given after ``--prefill URL``: this prefill node's ``--disaggregation-bootstrap-port``)
and a random ``bootstrap_room``. Each node runs it on the same path as its Worker gRPC servicer
(``WorkerServicer.run_request``), so rooms, KV transfer, deadlines and aborts are those of our own router:

- prefill: ``Prefill(room)`` on DP rank ``room % dp_size`` (SGLang's ``follow_bootstrap_room``) unless the body
  names one; answers once the KV reached the decode node.
- decode: ``Decode(room, bootstrap_addr=bootstrap_host:bootstrap_port)``; the prefill DP rank is the body's
  ``disagg_prefill_dp_rank``, else ``room % prefill dp_size`` (from the prefill's Bootstrap topology, cached).
- null (colocated): ``Generate``.

The node tokenizes ``text`` and detokenizes outputs itself here (our router does both when it fronts the nodes).
A client that disconnects cancels its handler (``handler_cancellation``): the request is aborted on the node and
its pages freed. Every wait is bounded by ``--request-timeout`` (the node's own deadline) or a lookup deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from common import env
from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput, PrefillDone, TokenOut
from common.engine.sampling.params import for_choice
from common.errors import ErrorCode, InvalidRequestError
from common.node import front
from common.node.http_guard import HttpGuard
from common.node.sglang_openai import chat_to_generate, completion_to_generate
from common.node.sglang_protocol import (
    SglangRequest,
    decode_body,
    parse_generate,
)
from common.node.sglang_response import (
    HttpError,
    SglangResponse,
    error_response,
    full_choices,
    stream_choices,
)
from common.serving.client_gone import client_gone_middleware
from common.text.tokenizer import load_tokenizer
from common.wire.worker_auth import new_nonce, proof_matches
from pdcluster.v1 import bootstrap_pb2, bootstrap_pb2_grpc

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
BODY_READ_TIMEOUT_S = 30.0
TOPOLOGY_TTL_S = 30.0  # a prefill node's dp_size is re-read this often (a restarted node may change it)
TOPOLOGY_TIMEOUT_S = 5.0
TOPOLOGY_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", 16 << 10),)  # a Topology is a few bytes
TOKENIZE_INLINE_CHARS = 4096  # longer texts are tokenized on a thread, off the event loop
_RID_PREFIX = {"generate": "", "completions": "cmpl-", "chat": "chatcmpl-"}
HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400, ErrorCode.FAILED_PRECONDITION: 400, ErrorCode.RESOURCE_EXHAUSTED: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504, ErrorCode.CANCELLED: 503, ErrorCode.UNAVAILABLE: 503, ErrorCode.INTERNAL: 500,
}


class _GrpcProbeFilter(logging.Filter):
    """sglang-router first tries gRPC on a worker's address; aiohttp would log that HTTP/2 preface ("PRI * ...") as
    an error with a traceback on every registration."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI" in str(exc))


class _NoDeadline:
    """The ``context`` ``run_request`` reads its deadline from: none from the client, so ``--request-timeout``."""

    def time_remaining(self) -> float | None:
        return None


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


class SglangHttpServer:
    def __init__(self, args: ServerArgs, servicer: front.WorkerServicer) -> None:
        self.args = args
        self.servicer = servicer
        self.mode = args.disaggregation_mode
        self.model_path = servicer.model_path
        self.model_name = Path(self.model_path).name
        self.tokenizer = load_tokenizer(self.model_path)
        self._topology: dict[str, tuple[int, float]] = {}  # prefill bootstrap addr -> (dp_size, read at)
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.guard = HttpGuard(env.read_secret_file(args.api_key_file, "--api-key-file") if args.api_key_file
                               else env.api_key())
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[client_gone_middleware, self.guard.middleware])
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        app.router.add_get("/v1/models", self.models)
        self.app = app

    async def start(self) -> int:
        logging.getLogger("aiohttp.server").addFilter(_GrpcProbeFilter())
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        assert self._runner.server is not None
        self.guard.attach(self._runner.server)
        site = web.TCPSite(self._runner, self.args.host, self.args.sglang_http_port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        logger.info("SGLang HTTP worker API on %s:%d (%s)", self.args.host, self.port,
                    "API key required" if self.guard.api_key else "open: no --api-key; anyone who reaches the port "
                    "can generate")
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- plain endpoints -------------------------------------------------------------------------------------
    def _unhealthy(self) -> str | None:
        if self.servicer.draining:
            return "node is draining (shutting down)"
        if not self.servicer.ranks.alive():
            return "a scheduler rank process is not running"
        return None

    async def health(self, request: web.Request) -> web.Response:
        why = self._unhealthy()
        return web.Response(status=200) if why is None else error_response(503, why)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Every scheduler rank answers a load query within the deadline (a PD node cannot generate alone)."""
        why = self._unhealthy()
        if why is None:
            try:
                await self.servicer.ranks.get_load(timeout=TOPOLOGY_TIMEOUT_S)
            except TimeoutError:
                why = f"scheduler ranks did not answer within {TOPOLOGY_TIMEOUT_S:.0f} s"
        return web.Response(status=200) if why is None else error_response(503, why)

    async def server_info(self, request: web.Request) -> web.Response:
        a, cfg = self.args, self.servicer.model_config
        return _json({
            "model_path": self.model_name, "tokenizer_path": self.model_name, "served_model_name": self.model_name,
            "disaggregation_mode": a.disaggregation_mode, "disaggregation_bootstrap_port": a.disaggregation_bootstrap_port,
            "disaggregation_transfer_backend": a.kv_transfer_backend, "tp_size": a.tp_size, "dp_size": a.dp_size,
            "page_size": a.page_size, "context_length": cfg.context_len, "host": a.advertised_host,
            "port": self.port, "grpc_port": self.servicer.grpc_port, "max_total_num_tokens": self.servicer.ranks.max_total_tokens,
            "max_running_requests": a.max_running_requests, "dtype": a.dtype, "version": "pdcluster",
        })

    async def model_info(self, request: web.Request) -> web.Response:
        try:
            hf = json.loads((Path(self.model_path) / "config.json").read_text())
        except (OSError, ValueError):
            hf = {}
        return _json({
            "model_path": self.model_name, "tokenizer_path": self.model_name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": hf.get("model_type"),
            "architectures": hf.get("architectures"),
        })

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "pdcluster", "root": self.model_name,
            "max_model_len": self.servicer.model_config.context_len,
        }]})

    # -- generation ------------------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "generate")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        try:
            raw = await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
        except TimeoutError:
            return error_response(408, f"request body not received within {BODY_READ_TIMEOUT_S:.0f} s")
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
        try:
            obj = decode_body(raw)
            include_usage = False
            if api == "completions":
                obj, include_usage = completion_to_generate(obj)
            elif api == "chat":
                obj, include_usage, messages = chat_to_generate(obj)
                obj["input_ids"] = await self._chat_ids(messages)
            req = parse_generate(obj)
            rid = req.rid or request.headers.get("X-Request-ID") or _RID_PREFIX[api] + uuid.uuid4().hex
            if req.n > 1:
                return await self._serve_choices(request, req, rid, api)
            msg, rank = await self._node_request(req, rid, await self._tokenize(req))
        except InvalidRequestError as e:
            return error_response(400, str(e))
        except HttpError as e:
            return error_response(e.status, str(e))
        except front._Unavailable as e:
            return error_response(503, str(e))
        run = SglangResponse(self.tokenizer, self.model_name, req, rid, api, include_usage)
        outputs = self._outputs(msg, rank)
        if req.stream:
            return await run.stream(request, outputs)
        try:
            return _json(await run.full(outputs))
        except HttpError as e:
            return error_response(e.status, str(e))

    async def _serve_choices(self, request: web.Request, req: SglangRequest, rid: str,
                             api: str) -> web.StreamResponse:
        """``sampling_params.n`` > 1 on ``/generate``: one request per choice (rid ``<rid>-<i>``; a seeded request's
        choice i samples with seed + i), answered as SGLang does: a list of n bodies, or a stream whose chunks carry
        their choice's ``index``. Raises ``InvalidRequestError`` where choices are not served."""
        if api != "generate":
            raise InvalidRequestError("n must be 1 on this node's OpenAI API; ask /generate for sampling_params.n, or "
                                      "the pdcluster router, which serves n on its OpenAI API")
        if self.mode != "null":
            raise InvalidRequestError(
                "sampling_params.n > 1 needs a colocated node: the choices of a disaggregated request would share "
                "one bootstrap_room; send n requests with their own rooms, or use the pdcluster router")
        ids = await self._tokenize(req)
        runs, outputs = [], []
        for i in range(req.n):
            choice = dataclasses.replace(req, sampling=for_choice(req.sampling, i), n=1)
            msg, rank = await self._node_request(choice, f"{rid}-{i}", ids)
            runs.append(SglangResponse(self.tokenizer, self.model_name, choice, msg.rid, api, False))
            outputs.append(self._outputs(msg, rank))
        if req.stream:
            return await stream_choices(request, rid, runs, outputs)
        try:
            return _json(await full_choices(runs, outputs))
        except HttpError as e:
            return error_response(e.status, str(e))

    async def _tokenize(self, req: SglangRequest) -> list[int]:
        if req.input_ids is not None:
            vocab = self.servicer.model_config.vocab_size
            if max(req.input_ids) >= vocab:
                raise InvalidRequestError(f"input_ids must be token ids in [0, {vocab}), got {max(req.input_ids)}")
            return req.input_ids
        assert req.text is not None
        if len(req.text) <= TOKENIZE_INLINE_CHARS:
            ids = self.tokenizer.encode(req.text)
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, req.text)
        if not ids:
            raise InvalidRequestError("text encodes to no tokens")
        return list(ids)

    async def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the model's chat template, then encoded as our router encodes it."""
        def render() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # jinja raises anything (TemplateError, TypeError) on input the template rejects
                raise InvalidRequestError(f"messages: the model's chat template rejected them: {e}") from e
            return list(self.tokenizer.encode(text, add_special_tokens=False))

        size = sum(len(m["content"]) for m in messages)
        ids = render() if size <= TOKENIZE_INLINE_CHARS else await asyncio.to_thread(render)
        if not ids:
            raise InvalidRequestError("messages render to no tokens")
        return ids

    async def _node_request(self, req: SglangRequest, rid: str, ids: list[int]) -> tuple[GenerateReqInput, int]:
        """The node's message for this body and the DP rank it runs on (the checks our Worker servicers make)."""
        if self.servicer.draining:
            raise front._Unavailable("node is draining (shutting down); retry on another node")
        room = req.bootstrap_room if self.mode != "null" else None  # a colocated node ignores the bootstrap fields
        # NOTE: the room is in the node's request id: a retry of the router (a new room) never collides with an
        # attempt still unwinding on this node.
        msg = GenerateReqInput(
            rid=rid if room is None else f"{rid}@{room}", input_ids=ids, sampling_params=req.sampling,
            return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num, bootstrap_room=room,
            priority=req.priority, stream=req.stream,
        )
        dp = self.args.dp_size
        if self.mode == "null":
            return msg, self.servicer.check_rank(req.dp_rank, "dp_rank")
        if room is None:
            raise InvalidRequestError("bootstrap_room is required on a disaggregated node: put this node behind "
                                      "sglang-router --pd-disaggregation, which draws one per request")
        if self.mode == "prefill":
            own = self.args.disaggregation_bootstrap_port
            if req.bootstrap_port is not None and req.bootstrap_port != own:
                raise InvalidRequestError(
                    f"bootstrap_port {req.bootstrap_port} is not this prefill node's bootstrap port {own}: give "
                    f"sglang-router --prefill URL {own}")
            rank = req.dp_rank if req.dp_rank is not None else room % dp
            return msg, self.servicer.check_rank(rank, "routed_dp_rank")
        if not req.bootstrap_host:
            raise InvalidRequestError("bootstrap_host is required on a decode node: the prefill node's host")
        port = req.bootstrap_port if req.bootstrap_port is not None else self.args.disaggregation_bootstrap_port
        msg.bootstrap_addr = f"{req.bootstrap_host}:{port}"
        prefill_dp = await self._prefill_dp_size(msg.bootstrap_addr)  # NOTE: first: it proves the address
        msg.prefill_dp_rank = req.prefill_dp_rank if req.prefill_dp_rank is not None else room % prefill_dp
        return msg, self.servicer.check_rank(req.dp_rank, "dp_rank")

    async def _prefill_dp_size(self, addr: str) -> int:
        """The DP size of the prefill node at ``addr`` (a client named it), once that node proved the cluster secret
        (``GetTopology`` with a challenge); a node that does not is refused before any slot or KV Hello."""
        now = time.monotonic()
        cached = self._topology.get(addr)
        if cached is not None and now - cached[1] < TOPOLOGY_TTL_S:
            return cached[0]
        nonce = new_nonce()
        try:
            async with grpc.aio.insecure_channel(addr, options=TOPOLOGY_CHANNEL_OPTIONS) as channel:
                reply = await bootstrap_pb2_grpc.BootstrapStub(channel).GetTopology(
                    bootstrap_pb2.GetTopologyRequest(nonce=nonce, address=addr), timeout=TOPOLOGY_TIMEOUT_S
                )
        except grpc.aio.AioRpcError as e:
            raise HttpError(503, f"cannot read the prefill node's topology from its bootstrap service {addr}: "
                                 f"{e.details() or e.code().name}") from None
        if not proof_matches(reply.membership_proof, nonce, addr):
            logger.warning("SGLang HTTP: refused bootstrap address %s: it did not prove the cluster secret", addr)
            raise HttpError(403, f"bootstrap_host:bootstrap_port {addr} is not a prefill node of this cluster (it did "
                                 "not prove PDCLUSTER_CLUSTER_TOKEN); name a prefill node's host and bootstrap port")
        dp_size = reply.dp_size
        self._topology[addr] = (dp_size, now)
        return dp_size

    async def _outputs(self, msg: GenerateReqInput, rank: int) -> AsyncIterator[TokenOut | PrefillDone]:
        """The node's outputs for ``msg`` until the final one; failures raise ``HttpError``."""
        try:
            async with contextlib.aclosing(self.servicer.run_request(msg, rank, _NoDeadline())) as outs:
                async for out in outs:
                    if out.error_code is not None:
                        raise HttpError(HTTP_STATUS[out.error_code], out.error or "request failed")
                    yield out
        except InvalidRequestError as e:
            raise HttpError(400, str(e)) from None
        except front._Overloaded as e:
            raise HttpError(503, str(e)) from None
        except front._Deadline as e:
            raise HttpError(504, str(e)) from None
        except front._Unavailable as e:
            raise HttpError(503, str(e)) from None
