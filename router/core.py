"""``RouterCore``: route one request, run its attempts with retries, stream its output.

Per request: pick a prefill worker P and a decode worker D (separate policies), a DP rank on each by load, and a
fresh bootstrap room; run the PD attempt; stream D's tokens. An attempt that failed before producing a token is
retried - new room, the failed worker excluded while another exists, exponential backoff with jitter - within
``max_retries`` and the deadline. One that failed after producing tokens is migrated (``max_migrations``): the next
attempt's prompt is the client's prompt plus the tokens so far, ``GenerateRequest.prior_output_len`` marks them as
outputs, and one ``OutputState`` spans the attempts, so the client sees each token once. A fleet of colocated
workers (``--worker``) is served the same way with one ``Generate`` leg; PD pairs are preferred when both exist.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.errors import CapacityError, InvalidRequestError
from pdcluster.v1 import worker_pb2
from router.admission import Admission, HeldRequests, NoRoom, NotAdmitted, hold_order
from router.candidates import Candidates
from router.choices import pin_fits
from router.config import Role, RouterConfig
from router.errors import DeadlineError, LegError, OverloadedError, RouterError, UnavailableError
from router.failure_log import FailureLog
from router.inputs import InputProcessor
from router.legs import Aborter, ColocatedAttempt, PdAttempt
from router.metrics import RouterMetrics
from router.migration import ended_by, node_request
from router.output import OutputState
from router.policies import Policy, RouteHint, make_policy, pick_rank
from router.request import Delta, Final, GenRequest
from router.room_allocator import RoomAllocator
from router.timing_store import TimingStore
from router.workers import Lease, Registry, Worker

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


@dataclass(slots=True)
class Plan:
    """One attempt's choice: P and D (PD) or only D (colocated), with their ranks and leases."""

    leases: list[Lease]
    room: int
    prefill: Worker | None
    prefill_rank: int
    worker: Worker  # decode or colocated
    rank: int

    @property
    def served_by(self) -> str:
        """The workers' names, never their addresses (clients see this)."""
        return f"{self.prefill.name} -> {self.worker.name}" if self.prefill else self.worker.name


@dataclass(slots=True)
class Progress:
    """What one request's attempts share: its output so far and what their failures taught."""

    out: OutputState
    failed: set[str] = field(default_factory=set)  # workers that failed it: avoided while another exists
    exhausted: set[str] = field(default_factory=set)  # workers that answered RESOURCE_EXHAUSTED to it
    migrations: list[dict[str, Any]] = field(default_factory=list)  # one record per migration (the timing shows them)
    attempt: int = 0  # attempts that failed so far
    retries: int = 0  # of those, the ones that failed without producing a token
    first_dispatched_at: float | None = None
    first_leg: PdAttempt | ColocatedAttempt | None = None  # the attempt that produced the first token


class RouterCore:
    def __init__(
        self,
        cfg: RouterConfig,
        inputs: InputProcessor,
        tokenizer_hf: object,
        metrics: RouterMetrics,
        registry: Registry,
    ) -> None:
        self.cfg = cfg
        self.inputs = inputs
        self.tokenizer_hf = tokenizer_hf
        self.metrics = metrics
        self.registry = registry
        self.rng = random.Random()
        self.prefill_policy = make_policy(cfg.prefill_policy, cfg, self.rng)
        self.decode_policy = make_policy(cfg.decode_policy, cfg, self.rng)
        self.colocated_policy = make_policy(cfg.prefill_policy, cfg, self.rng)
        self.rooms = RoomAllocator()
        self.aborter = Aborter(cfg.rpc_timeout_s, metrics)
        self.timings = TimingStore(cfg.timing_keep, cfg.timing_ttl_s)
        self.active: set[str] = set()
        metrics.inflight.set_function(lambda: len(self.active))  # read at each scrape, not kept per request
        self.admission = Admission(cfg.max_inflight_requests, registry.request_capacity)
        self.held = HeldRequests()  # requests waiting for a decode worker's room (``_plan``)
        self.failures = FailureLog(logger)  # one line per failed request, an outage's repeats folded

    def forget_worker(self, address: str) -> None:
        for p in (self.prefill_policy, self.decode_policy, self.colocated_policy):
            p.forget(address)

    # -- the request loop ------------------------------------------------------------------------------------
    async def generate(self, req: GenRequest) -> AsyncIterator[Delta | Final]:
        """Deltas (streaming requests only), then exactly one Final; or raises a typed error."""
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
            outcome = {
                grpc.StatusCode.UNAVAILABLE: "unavailable",
                grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
                grpc.StatusCode.INVALID_ARGUMENT: "invalid",
                grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
            }.get(e.code, "error")
            self.failures.failed(req.rid, e.code.name, e.log_text())
            raise
        finally:
            self.active.discard(req.rid)
            self.admission.rate.completed()
            self.metrics.requests.labels(req.api, outcome).inc()

    async def _attempts(self, req: GenRequest) -> AsyncIterator[Delta | Final]:
        """Attempts until one finishes: route, run, and on a leg's failure decide (give up, migrate, retry), then
        back off. An attempt that fails before producing a token is retried (``max_retries``); one that fails after
        producing tokens is migrated (``max_migrations``): the next attempt's prompt is the original prompt plus every
        token so far, and one ``OutputState`` (ids, detokenizer, stop strings, logprobs) carries on, so the client
        sees each token once."""
        pr = Progress(OutputState(req, self.inputs.tok, self.metrics))
        while True:
            node_req = node_request(req, pr.out.ids, req.rid if pr.attempt == 0 else f"{req.rid}#{pr.attempt}")
            plan = await self._plan(req, pr.failed, len(node_req.input_ids))
            produced_before = len(pr.out.ids)
            try:
                async for ev in self._run(req, node_req, plan, pr):
                    yield ev
                return
            except LegError as e:
                self._blame(plan, e)
                if not e.retryable:
                    if pr.out.ids and req.stream:
                        raise RouterError(f"the request failed after streaming began: {e}", e.code,
                                          e.internal) from None
                    raise
                pr.attempt += 1
                pr.failed.add(e.worker)
                if len(pr.out.ids) > produced_before:
                    ended = self._migrate(req, plan, e, pr)
                    if ended is not None:  # the failed leg had sent the last token but not its Finished
                        for ev in ended:
                            yield ev
                        return
                    continue  # no backoff: the next attempt goes to another worker while one exists
                backoff = self._retry_backoff(req, plan, e, pr)
                if backoff > 0:
                    await asyncio.sleep(backoff)
            finally:
                for lease in plan.leases:
                    lease.release()
                self.rooms.release(plan.room)

    async def _run(
        self, req: GenRequest, node_req: worker_pb2.GenerateRequest, plan: Plan, pr: Progress
    ) -> AsyncIterator[Delta | Final]:
        """One attempt on ``plan``: deltas (streaming requests), then its Final; raises ``LegError`` on failure."""
        dispatched_at = time.monotonic()
        out = pr.out
        client = req.delta_sink if req.stream else None

        def take(msg: worker_pb2.GenerateResponse) -> bool:
            """The leg's sink: a chunk that arrives while this task waits goes to the client from here, with no
            wake-up of this task; the task looks again only when a stop string matched in it."""
            if client is None or out.stopped or not client.ready() or msg.WhichOneof("kind") != "chunk":
                return False
            delta = out.add(msg.chunk)
            if pr.first_dispatched_at is None and out.ids:
                pr.first_dispatched_at, pr.first_leg = dispatched_at, leg
            if delta is not None and (delta.text or delta.token_ids):
                client.write(delta)
            if out.stopped:
                leg.wake()
            return True

        sink = take if client is not None else None
        leg: PdAttempt | ColocatedAttempt
        if plan.prefill is not None:
            leg = PdAttempt(node_req, plan.prefill, plan.prefill_rank, plan.worker, plan.rank, plan.room,
                            req.deadline, self.aborter, sink)
        else:
            if plan.worker.dp_size > 1:
                node_req.dp_rank = plan.rank
            leg = ColocatedAttempt(node_req, plan.worker, req.deadline, self.aborter, sink)
        fin: worker_pb2.Finished | None = None
        async with contextlib.aclosing(leg.stream()) as msgs:
            async for msg in msgs:
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    delta = out.add(msg.chunk)
                elif kind == "finished":
                    fin = msg.finished
                    if fin.finish_reason == "abort":
                        raise LegError(f"the {plan.worker.role} worker aborted the request", grpc.StatusCode.ABORTED,
                                       plan.worker.address, True)
                    delta = out.add(fin.last, final=True)
                else:  # the sink's wake-up (``legs.WAKE``): it took a chunk that matched a stop string
                    delta = None
                if pr.first_dispatched_at is None and out.ids:
                    pr.first_dispatched_at, pr.first_leg = dispatched_at, leg
                if req.stream and delta is not None and (delta.text or delta.token_ids):
                    yield delta
                if out.stopped:
                    break  # closing the legs aborts them on both nodes
        if not out.ids:
            raise LegError("the request finished without producing a token", grpc.StatusCode.INTERNAL,
                           plan.worker.address, True)
        for lease in plan.leases:
            lease.worker.breaker.record_success()
        yield self._final(req, pr, fin, plan, pr.attempt + 1)

    def _final(self, req: GenRequest, pr: Progress, fin: worker_pb2.Finished | None, plan: Plan,
               attempts: int) -> Final:
        assert pr.first_dispatched_at is not None  # a token was produced
        final = pr.out.finish(fin, _prefill_resp(pr.first_leg), plan.served_by, attempts, pr.first_dispatched_at,
                              pr.migrations)
        self.timings.put(req.rid, {**final.timing, "served_by": final.served_by})
        return final

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
            return [*last, self._final(req, pr, None, plan, pr.attempt)]
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

    # -- routing ---------------------------------------------------------------------------------------------
    async def _plan(self, req: GenRequest, failed: set[str], prompt_len: int) -> Plan:
        """``_route``, holding the request while every routable decode worker's last report says it cannot admit
        it: until a report or a lease's release changes that, at most ``--admission-wait`` seconds and never past
        the request's deadline (then 429 / DEADLINE_EXCEEDED). Held requests are bounded by the in-flight limit and
        route most urgent first (``HeldRequests``)."""
        give_up = min(req.deadline, time.monotonic() + self.cfg.admission_wait_s)
        try:
            return await self.held.route_in_order(
                lambda: self._route(req, failed, prompt_len),
                lambda seq: hold_order(req.priority, req.arrival, self.registry.low_priority_values_first(), seq),
                lambda timeout: self.registry.wait_room_change("decode", timeout),
                give_up,
            )
        except NotAdmitted as e:
            if time.monotonic() >= req.deadline:
                raise DeadlineError(f"request deadline exceeded while {e}") from None
            raise OverloadedError(f"{e} within {self.cfg.admission_wait_s:g} s (--admission-wait); retry "
                                  "later", self.admission.rate.wait_s(1)) from None

    def _route(self, req: GenRequest, failed: set[str], prompt_len: int) -> Plan:
        """``prompt_len``: the node's prompt (after a migration, the client's prompt plus the tokens so far)."""
        hint = RouteHint(req.input_ids, len(req.input_ids) + req.max_new_tokens)
        prefills = self._candidates("prefill", failed, prompt_len)
        # A decode node admits by the prompt (its generation headroom is reserved per active request).
        decodes = self._candidates("decode", failed, prompt_len, req.priority)
        pin = req.pin
        if prefills and decodes:
            if pin is not None and pin_fits(pin, failed, decodes, prefills):
                p, p_rank, d, d_rank = pin.prefill, pin.prefill_rank, pin.worker, pin.rank
                self.prefill_policy.routed(p, p_rank, hint)
                self.decode_policy.routed(d, d_rank, hint)
            else:
                p, p_rank = self._choose(self.prefill_policy, prefills, hint, prompt_len)
                d, d_rank = self._choose(self.decode_policy, decodes, hint, hint.tokens)
                if pin is not None and pin.worker is None:
                    pin.prefill, pin.prefill_rank, pin.worker, pin.rank = p, p_rank, d, d_rank
            leases = [
                Lease(p, p.ranks[p_rank], prompt_len, p.pages_for(prompt_len)),
                Lease(d, d.ranks[d_rank], hint.tokens, d.pages_for(hint.tokens)),
            ]
            self.metrics.dispatches.labels(p.address, "prefill").inc()
            self.metrics.dispatches.labels(d.address, "decode").inc()
            return Plan(leases, self.rooms.acquire(), p, p_rank, d, d_rank)
        colocated = self._candidates("colocated", failed, hint.tokens)
        if colocated:
            if pin is not None and pin_fits(pin, failed, colocated):
                w, rank = pin.worker, pin.rank
                self.colocated_policy.routed(w, rank, hint)
            else:
                w, rank = self._choose(self.colocated_policy, colocated, hint, hint.tokens)
                if pin is not None and pin.worker is None:
                    pin.worker, pin.rank = w, rank
            self.metrics.dispatches.labels(w.address, "colocated").inc()
            return Plan([Lease(w, w.ranks[rank], hint.tokens, w.pages_for(hint.tokens))], 0, None, 0, w, rank)
        raise UnavailableError(self._why_unavailable(prefills, decodes, detail=False),
                               internal=self._why_unavailable(prefills, decodes, detail=True))

    def _candidates(self, role: Role, failed: set[str], tokens: int, priority: int | None = None) -> Sequence[Worker]:
        """Routable workers of ``role`` that can hold the request (decode: only those, or those where a request of
        ``priority`` may preempt a running one; ``NoRoom`` when none can), not yet failed for this request if
        possible.

        O(1) in the number of workers while none failed this request and the role's smallest free KV fits it (the
        registry keeps both views current); the per-worker filters run only when they can remove someone."""
        ws: Sequence[Worker] = self.registry.routable(role)
        # NOTE: free >= pages_for(tokens) <=> free * page_size >= tokens, so min_free_tokens >= tokens: all fit.
        # A decode worker whose last report cannot admit the request is never sent it, even when it is the only one
        # or the only one that has not failed this request.
        strict = role == "decode"
        if (len(ws) > 1 or strict) and ws and self.registry.min_free_tokens(role) < tokens:
            fit = Candidates()
            for w in ws:
                free = w.free_pages()
                if free is None or free >= w.pages_for(tokens) or (strict and w.can_preempt_for(priority)):
                    fit.append(w)
            if strict and not fit:
                raise NoRoom(f"no decode worker reported room for the request's {tokens} prompt tokens "
                             f"({len(ws)} routable)")
            ws = fit or ws
        if len(ws) > 1 and failed:
            ws = Candidates(w for w in ws if w.address not in failed) or ws
        return ws

    def _choose(
        self, policy: Policy, workers: Sequence[Worker], hint: RouteHint, tokens: int
    ) -> tuple[Worker, int]:
        w, rank = policy.pick(workers, hint)
        if rank is None:
            rank = pick_rank(w, w.pages_for(tokens))
        policy.routed(w, rank, hint)
        return w, rank

    def _why_unavailable(self, prefills: Sequence[Worker], decodes: Sequence[Worker], detail: bool) -> str:
        """Why no worker can take a request: per worker with ``detail`` (logs), else counts per state (clients)."""
        reg = self.registry
        if not reg.workers:
            return "no workers are registered with the router"

        def describe(role: Role) -> str:
            ws = [w for w in reg if w.role == role]
            if not ws:
                return f"no {role} workers registered"
            if detail:
                states = ", ".join(f"{w.address} {_state(w)}" for w in ws)
            else:
                counts = collections.Counter(_state(w).split(":", 1)[0] for w in ws)
                states = f"{len(ws)} registered: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
            return f"no routable {role} worker ({states})"

        if reg.has_role("prefill") or reg.has_role("decode"):
            parts = [describe(r) for r, got in (("prefill", prefills), ("decode", decodes)) if not got]
            return "; ".join(parts)
        return describe("colocated")


def _prefill_resp(leg: PdAttempt | ColocatedAttempt | None) -> worker_pb2.PrefillResponse | None:
    """P's answer for a PD attempt (read at the end: D may stream before P's RPC returns)."""
    return leg.prefill_resp if isinstance(leg, PdAttempt) else None


STATE_TEXT = {"unproven": "not proven a cluster member yet", "unreachable": "not reachable yet", "ready": "ok"}


def _state(w: Worker) -> str:
    state = w.state
    if state == "rejected":
        return f"unusable: {w.error}"
    return STATE_TEXT.get(state, state.replace("_", " ", 1))  # circuit_open -> "circuit open"
