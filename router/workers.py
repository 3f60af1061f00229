"""Worker registry: one ``Worker`` per node address, with its channel, server info, load and in-flight counts.

Load a policy sees for one DP rank = the node's last ``GetLoad`` report (polled by ``router.monitor``) plus what
this router dispatched to the rank and has not yet finished (``RankState.inflight``). KV pages this router
dispatched *since the last report* are subtracted from the reported free pages (``reserved_pages``); a new report
resets that, because the node's own count then includes them.

Membership: a worker gets no credential and no request before it proved the cluster secret (``router.membership``):
until ``admit`` its channel sends only ``ProveMembership`` and health checks, without the credential. Clients see a worker only by its ``name`` (``prefill-0``, ``decode-1``, ... in registration order); the
address stays on the admin surface.

Routing reads the registry's per-role views (``router.candidates``), which workers keep current: a write to a field
that decides routability (``_Watched``) or a circuit closing/opening calls ``state_changed``; a change of free KV
pages (a lease, its release, a load report, new server info) calls ``free_changed``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any, Generic, TypeVar, overload

from grpc_health.v1 import health_pb2_grpc

from common.wire.worker_auth import aio_worker_channel
from pdcluster.v1 import worker_pb2, worker_pb2_grpc
from router.breaker import CircuitBreaker
from router.candidates import Candidates, RoleView
from router.config import Role, RouterConfig, WorkerSpec
from router.mux import MuxLink

logger = logging.getLogger(__name__)

MODE_OF_ROLE = {"prefill": "prefill", "decode": "decode", "colocated": "null"}
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # A restarted worker is reachable again within ~0.1-2 s instead of grpc's default backoff of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
    # A connection that stops answering (host gone, partition: no RST) fails its Mux stream, and with it every leg
    # on it (retried or migrated elsewhere), within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS instead of each leg's
    # deadline. Nodes accept pings this often (common/node/serve.py NODE_SERVER_OPTIONS).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)


def node_channel_options(cfg: RouterConfig) -> tuple[tuple[str, object], ...]:
    if cfg.tls_server_name is None:
        return CHANNEL_OPTIONS
    return (*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", cfg.tls_server_name))


class RankState:
    __slots__ = ("epoch", "inflight", "inflight_tokens", "rank", "report", "reserved_pages")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.report: worker_pb2.RankLoad | None = None
        self.epoch = 0  # bumped by each report
        self.inflight = 0
        self.inflight_tokens = 0
        self.reserved_pages = 0

    def queued(self) -> int:
        """Requests on the node not yet running (any router's), plus this router's in flight here."""
        r = self.report
        waiting = 0 if r is None else r.waiting + r.bootstrap + r.prealloc + r.transfer
        return waiting + self.inflight

    def free_pages(self, page_size: int) -> int | None:
        """Pages a new request may use (None: no report yet, unknown)."""
        r = self.report
        if r is None:
            return None
        if r.HasField("admissible_tokens"):  # a decode node: its own admission budget
            return r.admissible_tokens // max(page_size, 1) - self.reserved_pages
        return r.free_kv_pages + r.evictable_tokens // max(page_size, 1) - self.reserved_pages


class Lease:
    """What one attempt holds on one worker rank; ``release`` exactly once when the attempt ends."""

    __slots__ = ("epoch", "pages", "released", "state", "tokens", "worker")

    def __init__(self, worker: Worker, state: RankState, tokens: int, pages: int) -> None:
        self.worker, self.state, self.tokens, self.pages = worker, state, tokens, pages
        self.epoch = state.epoch
        self.released = False
        worker.inflight += 1
        worker.inflight_tokens += tokens
        state.inflight += 1
        state.inflight_tokens += tokens
        state.reserved_pages += pages
        worker.breaker.on_dispatch()
        if pages:
            worker.free_changed()

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        w, s = self.worker, self.state
        w.inflight -= 1
        w.inflight_tokens -= self.tokens
        s.inflight -= 1
        s.inflight_tokens -= self.tokens
        if s.epoch == self.epoch and self.pages:  # otherwise a newer report already accounts for these pages
            s.reserved_pages = max(0, s.reserved_pages - self.pages)
            w.free_changed()
        if w.removed and w.inflight == 0:
            w.close_soon()


T = TypeVar("T")


class _Watched(Generic[T]):
    """A worker field that decides whether it is routable: a write that changes it calls ``state_changed``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Watched[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> T | _Watched[T]:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: T) -> None:
        old = getattr(obj, self.slot, _UNSET)
        if old is value or (old is not _UNSET and old == value):
            return
        setattr(obj, self.slot, value)
        obj.state_changed()


_UNSET = object()


class Worker:
    # Routability inputs (see _Watched). Why the worker is not usable (ListWorkers and logs show it), by what found
    # it: the membership proof, its server info (mode, absurd or disagreeing facts), its load reports.
    proven: _Watched[bool] = _Watched()  # proved the cluster secret since it last turned unhealthy
    healthy: _Watched[bool] = _Watched()
    removed: _Watched[bool] = _Watched()
    info: _Watched[worker_pb2.ServerInfo | None] = _Watched()
    proof_error: _Watched[str] = _Watched()
    info_error: _Watched[str] = _Watched()
    load_error: _Watched[str] = _Watched()

    def __init__(self, spec: WorkerSpec, cfg: RouterConfig, name: str = "") -> None:
        self.view: RoleView[Worker] | None = None  # the registry's view of this worker's role (None: not registered)
        self.seq = 0  # registration order (set by the registry)
        self.spec = spec
        self.address = spec.address
        self.name = name or spec.role
        self.role: Role = spec.role
        self.host = spec.address.rsplit(":", 1)[0]
        self.proven = False
        # NOTE: calls carry the credential only while ``proven``; ``ProveMembership`` never does.
        self.channel = aio_worker_channel(spec.address, node_channel_options(cfg),
                                          cfg.tls.grpc_channel_credentials() if cfg.tls.mutual else None,
                                          admitted=lambda: self.proven)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)  # requests go only to routable (so proven) workers
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.mux = MuxLink(  # the request legs' stream, opened on first use
            self.stub, spec.address, use_socket=cfg.mux_transport == "socket",
            socket_ssl=cfg.tls.client_ssl_context() if cfg.tls.mutual else None, server_hostname=cfg.tls_server_name)
        self.breaker = CircuitBreaker(cfg.cb_failure_threshold, cfg.cb_open_s)
        self.breaker.on_change = self.state_changed
        self.info = None
        self.proof_error = ""
        self.info_error = ""
        self.load_error = ""
        self.healthy = False
        self.health_failures = 0
        self.removed = False
        self.ranks: list[RankState] = [RankState(0)]
        self.page_size = 1
        self.inflight = 0
        self.inflight_tokens = 0
        self.rr = 0  # rotating tie-break among equally loaded ranks

    def state_changed(self) -> None:
        """Something that decides routability changed: the role's view rebuilds at the next decision."""
        if self.view is not None:
            self.view.invalidate()

    def free_changed(self) -> None:
        """Free KV pages (or the page size) changed: the role's capacity bound re-reads this worker."""
        if self.view is not None:
            self.view.capacity.touch(self)
            self.view.room_changed()

    # -- membership ---------------------------------------------------------------------------------------------
    def admit(self) -> None:
        """The worker proved the cluster secret: its calls carry the credential from now on."""
        self.proven, self.proof_error = True, ""

    def reject(self, why: str) -> None:
        self.proven, self.proof_error = False, why

    @property
    def error(self) -> str:
        return self.proof_error or self.info_error or self.load_error

    @property
    def state(self) -> str:
        if self.removed:
            return "removed"
        if self.error:
            return "rejected"
        if not self.healthy and self.info is not None:  # it served once; it re-proves itself when healthy again
            return "unhealthy"
        if not self.proven:
            return "unproven"
        if self.info is None:
            return "unreachable"
        if not self.healthy:
            return "unhealthy"
        if not self.breaker.allows():
            return f"circuit_{self.breaker.state}"
        return "ready"

    # -- facts from GetServerInfo ------------------------------------------------------------------------------
    def set_info(self, info: worker_pb2.ServerInfo) -> bool:
        """Adopt the worker's server info; False (with ``error`` set) when it cannot serve in its role."""
        want = MODE_OF_ROLE[self.role]
        if info.mode != want:
            self.info_error = (
                f"registered as {self.role} but the node runs in mode {info.mode!r} (expected {want!r})"
            )
            return False
        if self.role == "prefill" and not (self.spec.bootstrap_port or info.bootstrap_port):
            self.info_error = "prefill node reports no bootstrap port; pass --prefill HOST:PORT:BOOTSTRAP_PORT"
            return False
        self.info = info
        self.info_error = ""
        self.page_size = max(info.page_size, 1)
        dp = max(info.dp_size, 1)
        if len(self.ranks) != dp:
            self.ranks = [RankState(r) for r in range(dp)]
        self.free_changed()
        return True

    @property
    def bootstrap_addr(self) -> str:
        port = self.spec.bootstrap_port or (self.info.bootstrap_port if self.info else 0)
        return f"{self.host}:{port}"

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def usable_but_for_circuit(self) -> bool:
        return self.proven and self.info is not None and not self.error and self.healthy and not self.removed

    @property
    def routable(self) -> bool:
        # NOTE: ``usable_but_for_circuit`` and ``allows()`` inlined: every routing decision asks every worker.
        return (self.proven and self.healthy and not self.removed and self.info is not None
                and not (self.proof_error or self.info_error or self.load_error) and self.breaker.allows())

    def set_load(self, load: worker_pb2.GetLoadResponse) -> None:
        for r in load.ranks:
            if 0 <= r.dp_rank < len(self.ranks):
                s = self.ranks[r.dp_rank]
                s.report, s.epoch, s.reserved_pages = r, s.epoch + 1, 0
        self.free_changed()

    def free_pages(self) -> int | None:
        """The most pages any one rank can take now (None: unknown)."""
        if len(self.ranks) == 1:
            return self.ranks[0].free_pages(self.page_size)
        best: int | None = None
        for s in self.ranks:
            f = s.free_pages(self.page_size)
            if f is None:
                return None
            best = f if best is None else max(best, f)
        return best

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_preempt_for(self, priority: int | None) -> bool:
        """A decode node with priority scheduling reports that a request of ``priority`` could preempt a running
        one on some rank (``RankLoad.preempt_priority``), so sending it beats holding it for room."""
        if priority is None:
            return False
        low_first = self.info is not None and self.info.schedule_low_priority_values_first
        for s in self.ranks:
            r = s.report
            if r is not None and r.HasField("preempt_priority"):
                bound = r.preempt_priority
                if (priority < bound) if low_first else (priority > bound):
                    return True
        return False

    def close_soon(self) -> None:
        asyncio.get_running_loop().create_task(self.close())

    async def close(self) -> None:
        self.mux.close()
        await self.channel.close()


class Registry:
    """Workers by address. Mutated only on the event loop thread."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.workers: dict[str, Worker] = {}
        self._views: dict[Role, RoleView[Worker]] = {"prefill": RoleView(), "decode": RoleView(), "colocated": RoleView()}
        self._seq = 0
        self._names: dict[tuple[str, Role], str] = {}  # (address, role) -> name; kept across deregistration

    def add(self, spec: WorkerSpec) -> tuple[Worker, bool]:
        """Register (idempotent for the same address and role); returns (worker, created)."""
        old = self.workers.get(spec.address)
        if old is not None:
            if old.role != spec.role:
                raise ValueError(
                    f"worker {spec.address} is already registered as {old.role}; deregister it first"
                )
            return old, False
        w = Worker(spec, self.cfg, self._name(spec))
        self._seq += 1
        w.seq, w.view = self._seq, self._views[spec.role]
        self.workers[spec.address] = w
        w.view.add(w)
        logger.info("worker added: %s (%s) as %s", spec.address, spec.role, w.name)
        return w, True

    def remove(self, address: str) -> bool:
        """New requests stop going to the worker at once; its in-flight requests finish."""
        w = self.workers.pop(address, None)
        if w is None:
            return False
        w.removed = True
        self._views[w.role].remove(w)
        w.view = None
        if w.inflight == 0:
            w.close_soon()
        logger.info("worker removed: %s (%s), %d in flight", address, w.role, w.inflight)
        return True

    def _name(self, spec: WorkerSpec) -> str:
        key = (spec.address, spec.role)
        if key not in self._names:
            n = sum(1 for _, role in self._names if role == spec.role)
            self._names[key] = f"{spec.role}-{n}"
        return self._names[key]

    def peer_infos(self, w: Worker) -> list[worker_pb2.ServerInfo]:
        """Server infos of the other accepted workers of ``w``'s role (what ``w``'s facts must agree with)."""
        return [o.info for o in self.workers.values()
                if o is not w and o.role == w.role and o.info is not None and not o.error and not o.removed]

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self.workers.values()))

    def routable(self, role: Role) -> Candidates[Worker]:
        """Routable workers of ``role``. When none is, but some are held back by their circuit alone while their
        health checks pass, those: a breaker never blackholes a role whose workers say they serve. Read-only (the
        same list is handed out until a worker of the role changes); O(1) plus O(workers with a non-closed circuit).
        """
        return self._views[role].routable()

    def request_capacity(self) -> int | None:
        """Requests the ready workers hold at most by their own limits (``ServerInfo.max_requests_per_rank``): a PD
        pair's is the smaller bounded role's. None: unbounded (a role whose workers report no limit bounds nothing)."""
        views = self._views  # NOTE: O(1) per request: each view caches its sum until a worker changes
        groups: list[int | None] = []  # what each kind of serving (PD pairs, colocated workers) holds at most
        if views["prefill"].workers and views["decode"].workers:
            caps = [c for c in (views[r].request_capacity() for r in ("prefill", "decode")) if c is not None]
            groups.append(min(caps) if caps else None)
        if views["colocated"].workers:
            groups.append(views["colocated"].request_capacity())
        # No serving group, or one without a bound: nothing to refuse here (routing says why none can serve).
        return None if not groups or None in groups else sum(groups)  # type: ignore[arg-type]

    def low_priority_values_first(self) -> bool:
        """Whether the decode (or colocated) workers run --schedule-low-priority-values-first (a fleet agrees on
        it)."""
        return any(w.info.schedule_low_priority_values_first for role in ("decode", "colocated")
                   for w in self._views[role].workers if w.info is not None)

    async def wait_room_change(self, role: Role, timeout: float) -> None:
        await self._views[role].wait_room_change(timeout)

    def min_free_tokens(self, role: Role) -> float:
        """A lower bound of the KV tokens any worker of ``role`` can take now (inf: no worker reported yet)."""
        return self._views[role].capacity.min_tokens()

    def has_role(self, role: Role) -> bool:
        return any(w.role == role for w in self.workers.values())

    def context_len(self) -> int | None:
        lens = [
            w.info.context_len for w in self.workers.values()
            if w.info is not None and w.info.context_len > 0 and not w.error
        ]
        return min(lens) if lens else None

    async def close(self) -> None:
        for w in list(self.workers.values()):
            await w.close()
        self.workers.clear()
        self._views = {"prefill": RoleView(), "decode": RoleView(), "colocated": RoleView()}
