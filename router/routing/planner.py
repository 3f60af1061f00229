"""``Planner``: where one attempt of a request goes. A prefill worker P and a decode worker D (separate policies), or
one colocated worker when no P/D pair can serve (a fleet with both kinds serves by P/D pairs); a DP rank on each by
load; a fresh bootstrap room for a P/D pair; a lease on each rank until the attempt ends (``release``).

    plan    route, held (router/routing/hold.py) while every routable decode worker's last report says it cannot
            admit the request: until a report or a lease's release changes that, at most ``--admission-wait`` seconds
            and never past the request's deadline (then 429 / DEADLINE_EXCEEDED)
    route   each role's candidates (``Registry.candidates``: routable, with room, not failed by this request while
            another can take it), then where the request's first routed choice went while those still fit (``RoutePin``,
            n > 1), else each role's policy
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from common.serving.drain_rate import DrainRate
from router.config import Role, RouterConfig
from router.errors import DeadlineError, OverloadedError, UnavailableError
from router.fleet.registry import Registry
from router.fleet.worker import Lease, Worker
from router.metrics import RouterMetrics
from router.request import GenRequest, RoutePin
from router.routing.hold import HeldRequests, NotAdmitted, hold_order
from router.routing.policies import Policy, RouteHint, choose, make_policy
from router.routing.room_allocator import RoomAllocator

Want = tuple[Policy, Sequence[Worker], int]  # one worker an attempt needs: its role's policy, candidates, KV tokens


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


class Planner:
    def __init__(self, cfg: RouterConfig, registry: Registry, metrics: RouterMetrics, rate: DrainRate) -> None:
        """``rate``: the router's completions, for the Retry-After of a request that waited for room in vain."""
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.rate = rate
        rng = random.Random()
        self.prefill_policy = make_policy(cfg.prefill_policy, cfg, rng)
        self.decode_policy = make_policy(cfg.decode_policy, cfg, rng)
        self.colocated_policy = make_policy(cfg.prefill_policy, cfg, rng)
        self.rooms = RoomAllocator()
        self.held = HeldRequests()  # requests waiting for a decode worker's room, most urgent first

    def forget_worker(self, address: str) -> None:
        for p in (self.prefill_policy, self.decode_policy, self.colocated_policy):
            p.forget(address)

    async def plan(self, req: GenRequest, failed: set[str], prompt_len: int) -> Plan:
        """``route``, holding the request while no routable decode worker has room for it (the module's ``plan``).
        Held requests are bounded by the in-flight limit and route most urgent first (``HeldRequests``)."""
        give_up = min(req.deadline, time.monotonic() + self.cfg.admission_wait_s)
        try:
            return await self.held.route_in_order(
                lambda: self.route(req, failed, prompt_len),
                lambda seq: hold_order(req.priority, req.arrival, self.registry.low_priority_values_first(), seq),
                lambda timeout: self.registry.wait_room_change("decode", timeout),
                give_up,
            )
        except NotAdmitted as e:
            if time.monotonic() >= req.deadline:
                raise DeadlineError(f"request deadline exceeded while {e}") from None
            raise OverloadedError(f"{e} within {self.cfg.admission_wait_s:g} s (--admission-wait); retry "
                                  "later", self.rate.wait_s(1)) from None

    def route(self, req: GenRequest, failed: set[str], prompt_len: int) -> Plan:
        """``prompt_len``: the node's prompt (after a migration, the client's prompt plus the tokens so far)."""
        hint = RouteHint(req.input_ids, len(req.input_ids) + req.max_new_tokens)
        reg = self.registry
        prefills = reg.candidates("prefill", failed, prompt_len)
        # A decode node admits by the prompt (its generation headroom is reserved per active request).
        decodes = reg.candidates("decode", failed, prompt_len, req.priority)
        wants: tuple[Want, ...]
        if prefills and decodes:  # P holds the prompt, D the prompt and the output to come
            wants = ((self.prefill_policy, prefills, prompt_len), (self.decode_policy, decodes, hint.tokens))
        else:
            colocated = reg.candidates("colocated", failed, hint.tokens)
            if not colocated:
                raise UnavailableError(why_unavailable(reg, prefills, decodes, detail=False),
                                       internal=why_unavailable(reg, prefills, decodes, detail=True))
            wants = ((self.colocated_policy, colocated, hint.tokens),)
        # Where the request's first routed choice went while those still fit (n > 1), else each role's policy's.
        pin = req.pin
        if pin is not None and pin_fits(pin, failed, wants):
            picks = pin.picks
            for (w, rank), (policy, _, _) in zip(picks, wants, strict=True):
                policy.routed(w, rank, hint)
        else:
            picks = [choose(policy, workers, hint, tokens) for policy, workers, tokens in wants]
            if pin is not None and not pin.picks:
                pin.picks = picks  # the first routed choice
        leases: list[Lease] = []
        for (w, rank), (_, _, tokens) in zip(picks, wants, strict=True):
            leases.append(Lease(w, w.ranks[rank], tokens, w.pages_for(tokens)))
            self.metrics.dispatches.labels(w.address, w.role).inc()
        if len(picks) == 1:
            w, rank = picks[0]
            return Plan(leases, 0, None, 0, w, rank)
        (p, p_rank), (d, d_rank) = picks
        return Plan(leases, self.rooms.acquire(), p, p_rank, d, d_rank)

    def release(self, plan: Plan) -> None:
        """The attempt ended: its leases and bootstrap room go back."""
        for lease in plan.leases:
            lease.release()
        self.rooms.release(plan.room)


def pin_fits(pin: RoutePin, failed: set[str], wants: tuple[Want, ...]) -> bool:
    """Whether a choice can go where its request's first routed choice went: the same kind of plan (P/D or
    colocated), every pinned worker still a candidate (routable, with room), and none failed this choice."""
    return len(pin.picks) == len(wants) and all(
        w.address not in failed and rank < len(w.ranks) and w in workers
        for (w, rank), (_, workers, _) in zip(pin.picks, wants, strict=True))


def why_unavailable(reg: Registry, prefills: Sequence[Worker], decodes: Sequence[Worker], detail: bool) -> str:
    """Why no worker can take a request: per worker with ``detail`` (logs), else counts per state (clients)."""
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


STATE_TEXT = {"unproven": "not proven a cluster member yet", "unreachable": "not reachable yet", "ready": "ok"}


def _state(w: Worker) -> str:
    state = w.state
    if state == "rejected":
        return f"unusable: {w.error}"
    return STATE_TEXT.get(state, state.replace("_", " ", 1))  # circuit_open -> "circuit open"
