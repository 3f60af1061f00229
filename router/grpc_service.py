"""``pdcluster.v1.Router`` servicer: proto <-> internal types at the boundary; a request's work is in the request
pipeline (router/pipeline.py), worker administration in ``RouterService``."""

from __future__ import annotations

import contextlib
import itertools
import uuid
from typing import Any

import grpc

from common.errors import InvalidRequestError, PdclusterError
from pdcluster.v1 import router_pb2, router_pb2_grpc
from router.errors import retry_after_of, status_of
from router.grpc_stream import GrpcStreamWriter
from router.request import ClientRequest, Final
from router.service import RouterService

OPTIONAL_SAMPLING = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "seed",
    "skip_special_tokens",
)
PLAIN_SAMPLING = ("min_new_tokens", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos")
ROLE_OF = {
    router_pb2.WORKER_ROLE_PREFILL: "prefill",
    router_pb2.WORKER_ROLE_DECODE: "decode",
    router_pb2.WORKER_ROLE_COLOCATED: "colocated",
}
PB_ROLE = {v: k for k, v in ROLE_OF.items()}


def sampling_from_proto(req: router_pb2.RouterGenerateRequest) -> dict[str, Any]:
    sp = req.sampling_params
    out: dict[str, Any] = {}
    for name in OPTIONAL_SAMPLING:
        if sp.HasField(name):
            out[name] = getattr(sp, name)
    for name in PLAIN_SAMPLING:
        out[name] = getattr(sp, name)
    out["stop"] = tuple(sp.stop)
    out["stop_token_ids"] = tuple(sp.stop_token_ids)
    if sp.logit_bias:
        out["logit_bias"] = dict(sp.logit_bias)
    constraint = sp.WhichOneof("constraint")
    if constraint is not None:
        out[constraint] = getattr(sp, constraint)
    return out


def final_to_proto(f: Final, index: int = 0) -> router_pb2.RouterGenerateResponse:
    c = router_pb2.Complete(
        index=index,
        request_id=f.rid,
        text=f.text,
        output_ids=f.output_ids,
        finish_reason=f.finish_reason,
        usage={
            "prompt_tokens": f.prompt_tokens,
            "completion_tokens": f.completion_tokens,
            "cached_tokens": f.cached_tokens,
        },
        timing=f.node_timing,
        logprobs=f.logprobs,
        top_logprobs=f.top_logprobs,
        served_by=f.served_by,
        attempts=int(f.timing.get("attempts", 1)),  # type: ignore[arg-type]
    )
    if f.spec is not None:
        c.spec.CopyFrom(f.spec)
    if f.matched_token is not None:
        c.matched_token = f.matched_token
    elif f.matched_stop is not None:
        c.matched_stop = f.matched_stop
    return router_pb2.RouterGenerateResponse(complete=c)


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            return value
    return None


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, service: RouterService) -> None:
        self.service = service
        self.pipeline = service.pipeline
        # request ids: a random per-process prefix + a counter (unique across replicas; no uuid4 per request)
        self._rid_prefix = f"gen-{uuid.uuid4().hex[:12]}-"
        self._rid_seq = itertools.count()

    async def Generate(self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Writes the response stream with ``context.write`` (router/grpc_stream.py)."""
        which = request.WhichOneof("input")
        kw: dict[str, Any] = {}
        if which == "text":
            kw["text"] = request.text
        elif which == "input_ids":
            kw["input_ids"] = list(request.input_ids.ids)
        elif which == "messages":
            kw["messages"] = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        remaining = context.time_remaining()
        try:
            n = request.n if request.HasField("n") else 1
            if not 1 <= n <= self.service.cfg.max_n:
                raise InvalidRequestError(
                    f"n must be between 1 and {self.service.cfg.max_n} on this router (--max-n), got {n}")
            req = await self.pipeline.admit(ClientRequest(
                rid=request.request_id or f"{self._rid_prefix}{next(self._rid_seq)}",
                api="grpc",
                sampling=sampling_from_proto(request),
                model=request.model,
                stream=request.stream,
                return_logprob=request.return_logprob,
                top_logprobs_num=request.top_logprobs_num,
                priority=request.priority if request.HasField("priority") else None,
                authorization=_authorization(context),
                timeout_s=remaining,
                max_tokens_field="sampling_params.max_new_tokens",
                **kw,
            ))
            if req.stream:
                writer = GrpcStreamWriter(context, final_to_proto)
                if n == 1:  # with several, the choices' events merge in a reader (``merge_choices``)
                    req.delta_sink = writer
                await writer.serve(self.pipeline.serve(req, n))
            else:
                async with contextlib.aclosing(self.pipeline.serve(req, n)) as events:
                    async for i, ev in events:
                        if isinstance(ev, Final):  # a request that does not stream has no deltas
                            await context.write(final_to_proto(ev, i))
        except PdclusterError as e:
            retry_after = retry_after_of(e)
            if retry_after is not None:
                context.set_trailing_metadata((("retry-after-ms", str(int(retry_after * 1000))),))
            await context.abort(status_of(e), str(e))

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(models=[self.service.model_name])

    async def ListWorkers(
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        return router_pb2.ListWorkersResponse(
            workers=[
                router_pb2.WorkerStatus(
                    address=s["address"],
                    role=PB_ROLE[s["role"]],
                    bootstrap_port=s["bootstrap_port"],
                    healthy=s["healthy"],
                    dp_size=s["dp_size"],
                    inflight_requests=s["inflight_requests"],
                    free_kv_pages=s["free_kv_pages"],
                    circuit_state=s["circuit_state"],
                    error=s["error"] or "",
                    state=s["state"],
                    name=s["name"],
                    legs_transport=s["legs_transport"],
                    mux_socket_error=s["mux_socket_error"],
                )
                for s in self.service.list_workers()
            ]
        )

    async def RegisterWorker(
        self, request: router_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RegisterWorkerResponse:
        role = ROLE_OF.get(request.role)
        if role is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "role must be PREFILL, DECODE or COLOCATED")
        try:
            await self.service.register(request.address, role, request.bootstrap_port or None)
        except PdclusterError as e:
            await context.abort(status_of(e), str(e))
        return router_pb2.RegisterWorkerResponse()

    async def DeregisterWorker(
        self, request: router_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DeregisterWorkerResponse:
        return router_pb2.DeregisterWorkerResponse(found=self.service.deregister(request.address))
