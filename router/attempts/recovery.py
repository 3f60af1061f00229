"""``Recovery``: after an attempt failed, whose fault it was and what follows.

    blame     a failure counts against the worker at fault (its circuit breaker): the other leg's worker when the
              failing one says its KV transfer peer broke it; never the request's or the load's fault
    give up   the error is not retryable (a failure after streaming began is never retried)
    migrate   the attempt produced tokens: the next attempt's prompt is the client's prompt plus the tokens so far
              (router/attempts/migration.py), at once, on another worker while one exists; at most
              ``--max-migrations`` times, never past the deadline; tokens that already end the request end it here
    retry     no token yet: the next attempt gets a new room and avoids the failed worker while another exists, after
              an exponential backoff with jitter, within ``--max-retries`` and the deadline; a worker at its request
              limit is retried at once on another (429 once every worker of its role is)
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc

from router.attempts.migration import ended_by
from router.attempts.run import AttemptRunner, Progress
from router.config import Role, RouterConfig
from router.errors import DeadlineError, LegError, OverloadedError, RouterError, UnavailableError
from router.fleet.registry import Registry
from router.metrics import RouterMetrics
from router.request import Delta, Final, GenRequest
from router.routing.planner import Plan

logger = logging.getLogger(__name__)

OVERLOAD_RETRY_AFTER_S = 1.0  # Retry-After when the router itself is full or a worker gave no hint

# Worker statuses that say nothing about the worker's health (the request itself is at fault).
NOT_WORKER_FAULTS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.CANCELLED,
    }
)


class Recovery:
    def __init__(self, cfg: RouterConfig, registry: Registry, metrics: RouterMetrics, runner: AttemptRunner) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.runner = runner  # the Final of a request its tokens so far end
        self.rng = random.Random()  # backoff jitter

    async def after(self, req: GenRequest, plan: Plan, e: LegError, pr: Progress,
                    produced_before: int) -> list[Delta | Final] | None:
        """After the attempt on ``plan`` failed with ``e`` (``produced_before``: tokens before it): None to go on
        with the next attempt (after its backoff), the request's last events when the tokens so far already end it,
        or raise when the request fails."""
        self._blame(plan, e)
        if not e.retryable:
            if pr.out.ids and req.stream:
                raise RouterError(f"the request failed after streaming began: {e}", e.code, e.internal) from None
            raise e
        pr.attempt += 1
        pr.failed.add(e.worker)
        if len(pr.out.ids) > produced_before:
            return self._migrate(req, plan, e, pr)  # no backoff: the next attempt goes to another worker if one exists
        backoff = self._retry_backoff(req, plan, e, pr)
        if backoff > 0:
            await asyncio.sleep(backoff)
        return None

    def _blame(self, plan: Plan, e: LegError) -> None:
        """Count a failure against the worker at fault (the circuit breaker), unless the request or load was."""
        if e.code in NOT_WORKER_FAULTS or e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return
        w = self.registry.workers.get(e.worker)
        if e.peer_fault and plan.prefill is not None:  # the other leg's worker broke the transfer
            w = plan.prefill if e.worker == plan.worker.address else plan.worker
        if w is not None:
            w.breaker.record_failure()

    def _migrate(self, req: GenRequest, plan: Plan, e: LegError, pr: Progress) -> list[Delta | Final] | None:
        """After a leg failed having produced tokens: None to go on with a new attempt, the request's last events
        when the tokens so far already end it, or raise when it may not migrate again or its deadline passed."""
        out = pr.out
        if len(pr.migrations) >= self.cfg.max_migrations:
            raise UnavailableError(
                f"the request failed after {len(out.ids)} output tokens and {len(pr.migrations)} "
                f"migration(s), the limit (--max-migrations); last error: {e}",
                internal=e.internal,
            ) from None
        leg_name = "generate" if plan.prefill is None else "decode"
        failed_worker = self.registry.workers.get(e.worker)
        pr.migrations.append(  # names, not addresses: clients see the timing
            {"after_tokens": len(out.ids), "leg": leg_name, "code": e.code.name,
             "failed": failed_worker.name if failed_worker is not None else leg_name,
             "at": time.monotonic() - req.arrival}
        )
        self.metrics.migrations.labels(leg_name).inc()
        logger.info("[rid=%s] %s leg failed after %d tokens (%s); migrating", req.rid, leg_name, len(out.ids),
                    e.log_text())
        ended = ended_by(req, out.ids)
        if ended is not None:
            delta = out.end_at_router(*ended)
            last: list[Delta | Final] = [delta] if req.stream and delta.text else []
            return [*last, self.runner.final(req, pr, None, plan, pr.attempt)]
        if time.monotonic() >= req.deadline:
            raise DeadlineError(
                f"request deadline exceeded after {len(out.ids)} output tokens; last error: {e}",
                internal=e.internal,
            ) from None
        return None

    def _retry_backoff(self, req: GenRequest, plan: Plan, e: LegError, pr: Progress) -> float:
        """After an attempt failed without producing a token: seconds to wait before the next one (0 after an
        overloaded worker: another of its role has not said it is full), or raise when no retry is left in the
        request's budget or deadline."""
        pr.retries += 1
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            pr.exhausted.add(e.worker)
            self._raise_if_all_exhausted(e, pr.exhausted)
            self.metrics.retries.labels("overloaded").inc()
            return 0.0
        now = time.monotonic()
        if now >= req.deadline:
            raise DeadlineError(
                f"request deadline exceeded after {pr.attempt} attempt(s); last error: {e}", internal=e.internal
            ) from None
        if pr.retries > self.cfg.max_retries:
            raise UnavailableError(f"all {pr.attempt} attempts failed; last error: {e}", internal=e.internal) from None
        backoff = min(self.cfg.retry_backoff_s * 2 ** (pr.retries - 1), self.cfg.retry_backoff_max_s)
        backoff *= 0.5 + self.rng.random() / 2
        if now + backoff >= req.deadline:
            raise DeadlineError(
                f"request deadline exceeded after {pr.attempt} attempt(s); last error: {e}", internal=e.internal
            ) from None
        if plan.prefill is None:
            leg_name = "generate"
        else:
            leg_name = "decode" if e.worker == plan.worker.address else "prefill"
        self.metrics.retries.labels(leg_name).inc()
        logger.info("[rid=%s room=%d] attempt %d failed (%s); retrying in %.0f ms", req.rid, plan.room, pr.attempt,
                    e.log_text(), backoff * 1000)
        return backoff

    def _raise_if_all_exhausted(self, e: LegError, exhausted: set[str]) -> None:
        """429 once every routable worker of the full worker's role answered RESOURCE_EXHAUSTED to this request."""
        w = self.registry.workers.get(e.worker)
        role: Role = w.role if w is not None else "colocated"
        others = [x for x in self.registry.routable(role) if x.address not in exhausted]
        if not others:
            raise OverloadedError(
                f"every {role} worker is at its request limit; retry later (last: {e})",
                e.retry_after_s if e.retry_after_s is not None else OVERLOAD_RETRY_AFTER_S,
                e.internal,
            ) from None
