"""``RequestPipeline``: a request's walk through the router, from its entry to its last event, one stage per room.

    entry    grpc_service.py (``pdcluster.v1.Router``) or openai/gateway.py (OpenAI HTTP) decodes the client's request
    admit    intake/: the router's request limit (before tokenizing), the client's priority ceiling, then validation
             and tokenization into a ``GenRequest``
    choices  choices.py: each of ``n`` choices is a request of its own; their events merge as they come
    per choice, attempts until one finishes it:
      route   routing/: held while no decode worker has room; a prefill and a decode worker (or one colocated
              worker), their DP ranks, leases and a bootstrap room
      legs    attempts/legs.py: Prefill on P and Decode on D start together (or Generate on a colocated worker)
      stream  attempts/run.py: D's tokens through the request's ``OutputState`` (attempts/output.py) to the client
      finish  the ``Final``; after a failed attempt (attempts/recovery.py) a retry when it produced no token (new
              room, the failed worker avoided, backoff) or a migration when it did (the next attempt continues from
              the tokens so far: one ``OutputState`` spans the attempts, so the client sees each token once)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from common.errors import CapacityError, InvalidRequestError
from router.attempts.legs import Aborter
from router.attempts.migration import node_request
from router.attempts.output import OutputState
from router.attempts.recovery import Recovery
from router.attempts.run import AttemptRunner, Progress
from router.choices import choice_requests, merge_choices
from router.config import RouterConfig
from router.drain import Drain
from router.errors import LegError, OverloadedError, RouterError
from router.failure_log import FailureLog
from router.fleet.registry import Registry
from router.intake.admission import Admission
from router.intake.inputs import InputProcessor
from router.intake.priority_policy import PriorityPolicy
from router.metrics import RouterMetrics
from router.request import ClientRequest, Delta, Final, GenRequest
from router.routing.planner import Planner
from router.timing_store import TimingStore

logger = logging.getLogger(__name__)

OUTCOME_OF_CODE = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
}


class RequestPipeline:
    def __init__(self, cfg: RouterConfig, inputs: InputProcessor, registry: Registry, metrics: RouterMetrics,
                 drain: Drain) -> None:
        self.cfg = cfg
        self.inputs = inputs
        self.registry = registry
        self.metrics = metrics
        self.drain = drain
        self.priorities = PriorityPolicy(cfg)
        self.active: set[str] = set()  # request ids in flight (admitted, not yet ended)
        metrics.inflight.set_function(lambda: len(self.active))  # read at each scrape, not kept per request
        self.admission = Admission(cfg.max_inflight_requests, registry.request_capacity)
        self.planner = Planner(cfg, registry, metrics, self.admission.rate)
        self.aborter = Aborter(cfg.rpc_timeout_s, metrics)
        self.timings = TimingStore(cfg.timing_keep, cfg.timing_ttl_s)
        self.runner = AttemptRunner(self.aborter, self.timings)
        self.recovery = Recovery(cfg, registry, metrics, self.runner)
        self.failures = FailureLog(logger)  # one line per failed request, an outage's repeats folded

    # -- admit ---------------------------------------------------------------------------------------------------
    async def admit(self, client: ClientRequest) -> GenRequest:
        """``client`` tokenized and checked, unless the router is full: then refused at once, before tokenizing
        (router/intake/admission.py)."""
        try:
            with self.admission.tokenizing_one(len(self.active)):
                client.priority = self.priorities.admit(
                    client.priority, client.authorization, self.registry.low_priority_values_first())
                return await self.inputs.build(client)
        except OverloadedError:
            self.metrics.requests.labels(client.api, "overloaded").inc()
            raise

    # -- choices -------------------------------------------------------------------------------------------------
    def serve(self, req: GenRequest, n: int = 1) -> AsyncIterator[tuple[int, Delta | Final]]:
        """``(choice, event)`` of each of ``req``'s ``n`` choices: deltas (streaming requests only), then exactly one
        Final per choice; or raises a typed error. Refused while the router drains (router/drain.py)."""
        return merge_choices([self.drain.guard(c.rid, self._generate(c)) for c in choice_requests(req, n)])

    async def _generate(self, req: GenRequest) -> AsyncIterator[Delta | Final]:
        """One choice: counted in flight from here to its end, by outcome."""
        if req.rid in self.active:
            raise InvalidRequestError(
                f"request_id {req.rid!r} is already in flight; request ids must be unique"
            )
        try:
            self.admission.check(len(self.active), with_tokenizing=False)  # tokenized already: ahead of those
        except OverloadedError:
            self.metrics.requests.labels(req.api, "overloaded").inc()
            raise
        self.active.add(req.rid)
        outcome = "cancelled"
        try:
            async for ev in self._attempts(req):
                yield ev
            outcome = "success"
        except (InvalidRequestError, CapacityError):
            outcome = "invalid"
            raise
        except RouterError as e:
            outcome = OUTCOME_OF_CODE.get(e.code, "error")
            self.failures.failed(req.rid, e.code.name, e.log_text())
            raise
        finally:
            self.active.discard(req.rid)
            self.admission.rate.completed()
            self.metrics.requests.labels(req.api, outcome).inc()

    # -- attempts: route -> legs -> stream -> finish -------------------------------------------------------------
    async def _attempts(self, req: GenRequest) -> AsyncIterator[Delta | Final]:
        """Attempts until one finishes the request; after a failed one, ``Recovery`` gives up, migrates or retries."""
        pr = Progress(OutputState(req, self.inputs.tok, self.metrics))
        while True:
            node_req = node_request(req, pr.out.ids, req.rid if pr.attempt == 0 else f"{req.rid}#{pr.attempt}")
            plan = await self.planner.plan(req, pr.failed, len(node_req.input_ids))
            produced_before = len(pr.out.ids)
            try:
                async for ev in self.runner.run(req, node_req, plan, pr):
                    yield ev
                return
            except LegError as e:
                ended = await self.recovery.after(req, plan, e, pr, produced_before)
                if ended is not None:  # the failed leg had sent the last token but not its Finished
                    for ev in ended:
                        yield ev
                    return
            finally:
                self.planner.release(plan)

    async def stop(self) -> None:
        """The router stops: the aborts in flight get their RPC timeout; the failure logs write their counts."""
        await self.aborter.drain(self.cfg.rpc_timeout_s)
        self.failures.close()
        self.aborter.failures.close()
