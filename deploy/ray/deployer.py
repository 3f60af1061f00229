"""``up`` / ``down`` / ``status`` of a pdcluster deployment on a Ray cluster (driver side).

Names, all in one Ray namespace: ``pdcluster-registry``, ``pdcluster-router-<i>``, ``pdcluster-prefill-<i>``,
``pdcluster-decode-<i>`` (detached actors, so the deployment outlives the ``ray up`` driver), the rank slots of a
node with several ranks ``pdcluster-slot-<role>-<i>-<bundle>``, and placement groups ``pdcluster-<role>[-<i>]``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.errors import ConfigError
from common.wire.security import CLUSTER_TOKEN_ENV
from deploy.ray.actors import REGISTRY_NAME, NodeActor, RankSlot, RouterActor, WorkerRegistry
from deploy.ray.placement import PinMode, ReplicaPlacement, actor_label_selector, plan_role
from deploy.spec import NODE_ROLES, ClusterSpec

logger = logging.getLogger(__name__)
PREFIX = "pdcluster"


@dataclass(frozen=True)
class RayOptions:
    namespace: str = "pdcluster"
    pin: PinMode = "resources"
    node_cpus: float = 1.0  # Ray CPU accounting per node replica (its processes use what they use)
    gpus_per_rank: int | None = None  # None: the spec's resources.gpus_per_rank of each node role
    router_cpus: float = 0.1
    start_timeout_s: float = 300.0


def actor_name(role: str, index: int) -> str:
    return f"{PREFIX}-{role}-{index}"


SLOT_PREFIX = f"{PREFIX}-slot-"


def slot_name(role: str, index: int, bundle: int) -> str:
    return f"{SLOT_PREFIX}{role}-{index}-{bundle}"


def secret_env(registry: ray.actor.ActorHandle) -> dict[str, object]:
    """Actor options handing the cluster secret (generated once, by the detached registry) to an actor's process."""
    return {"runtime_env": {"env_vars": {CLUSTER_TOKEN_ENV: ray.get(registry.cluster_secret.remote())}}}


def _bundle_options(place: ReplicaPlacement, pg: PlacementGroup, bundle: int, opts: RayOptions) -> dict[str, object]:
    options: dict[str, object] = {
        "namespace": opts.namespace, "lifetime": "detached",
        "num_cpus": place.num_cpus, "num_gpus": place.num_gpus, "resources": place.resources,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
    }
    selector = actor_label_selector(place.role, opts.pin)
    if selector:
        options["label_selector"] = selector
    return options


def _node_actor(spec: ClusterSpec, place: ReplicaPlacement, pg: PlacementGroup, opts: RayOptions,
                secret: dict[str, object]) -> ray.actor.ActorHandle:
    """The node actor in its rank 0 bundle, after a slot actor took each other rank's bundle."""
    p = spec.ports(place.role, place.index)
    argv = spec.node_argv(place.role, "{host}", place.index)
    slots = [RankSlot.options(name=slot_name(place.role, place.index, b),  # type: ignore[attr-defined]
                              **_bundle_options(place, pg, b, opts)).remote() for b in place.rank_bundles]
    where = ray.get([s.placement.remote() for s in slots], timeout=opts.start_timeout_s)
    options = {"name": actor_name(place.role, place.index), **_bundle_options(place, pg, place.bundle, opts), **secret}
    return NodeActor.options(**options).remote(  # type: ignore[attr-defined]
        place.role, argv, p.grpc, p.bootstrap, REGISTRY_NAME, opts.namespace, opts.start_timeout_s, p.metrics, where
    )


def gpus_per_rank(spec: ClusterSpec, override: int | None = None) -> dict[str, int]:
    """Ray ``num_gpus`` per TP rank of each node role: the spec's, or ``override``. A cuda spec with 0 GPUs per rank
    is refused (ConfigError), as is a cpu spec with GPUs."""
    if override is not None:
        if override < 0:
            raise ConfigError(f"--gpus-per-rank must be >= 0, got {override}")
        if spec.device == "cuda" and override == 0:
            raise ConfigError(f"--gpus-per-rank 0 with a device-cuda spec (profile {spec.profile}): every rank needs "
                              "a GPU; drop --gpus-per-rank to use the spec's, or pick a cpu profile")
        spec = spec.with_gpus_per_rank(override)
    return {role: spec.role(role).resources.gpus_per_rank for role in NODE_ROLES}


def check_one_host_groups(spec: ClusterSpec) -> None:
    """Ray packs a node's ranks on one machine (STRICT_PACK); a TP group spanning hosts is the LWS overlay's."""
    for role in NODE_ROLES:
        if spec.role(role).nnodes > 1:
            raise ConfigError(f"{role}.nnodes is {spec.role(role).nnodes}: on Ray a node's TP group runs on one "
                              "machine (one STRICT_PACK placement group); use nnodes 1 with a tp that fits a machine")


def up(spec: ClusterSpec, opts: RayOptions = RayOptions(), wait: bool = True) -> dict[str, object]:
    """Create the registry, the node placement groups and actors, and the routers. Returns the endpoints."""
    gpus_per_rank(spec, opts.gpus_per_rank)  # refuse a GPU spec without GPUs before creating anything
    check_one_host_groups(spec)
    registry = WorkerRegistry.options(  # type: ignore[attr-defined]
        name=REGISTRY_NAME, namespace=opts.namespace, lifetime="detached", get_if_exists=True, max_restarts=-1
    ).remote()
    ray.get(registry.snapshot.remote())
    secret = secret_env(registry)
    gpus = gpus_per_rank(spec, opts.gpus_per_rank)
    handles: list[ray.actor.ActorHandle] = []
    for role in NODE_ROLES:
        groups, places = plan_role(role, spec.role(role).replicas, spec.ranks(role), cpus_per_rank=opts.node_cpus,
                                   gpus_per_rank=gpus[role], pin=opts.pin, prefix=PREFIX)
        pgs = {}
        for g in groups:
            kwargs: dict[str, object] = {"strategy": g.strategy, "name": g.name, "lifetime": "detached"}
            if g.bundle_label_selector:
                kwargs["bundle_label_selector"] = g.bundle_label_selector
            pgs[g.name] = placement_group(g.bundles, **kwargs)  # type: ignore[arg-type]
        for pg in pgs.values():
            ray.get(pg.ready(), timeout=opts.start_timeout_s)
        handles += [_node_actor(spec, place, pgs[place.group], opts, secret) for place in places]
    routers = []
    for i in range(spec.role("router").replicas):
        p = spec.ports("router", i)
        routers.append(RouterActor.options(  # type: ignore[attr-defined]
            name=actor_name("router", i), namespace=opts.namespace, lifetime="detached", num_cpus=opts.router_cpus,
            **secret,
        ).remote(spec.router_argv("{host}", i), p.grpc, p.http, REGISTRY_NAME, opts.namespace))
    if wait:
        wait_healthy(handles + routers, opts.start_timeout_s)
        wait_routed(routers, len(handles), opts.start_timeout_s)
    return {"routers": ray.get([r.endpoints.remote() for r in routers]) if wait else []}


def wait_healthy(handles: list[ray.actor.ActorHandle], timeout: float) -> None:
    ray.get([h.check_health.remote() for h in handles], timeout=timeout)


def wait_routed(routers: list[ray.actor.ActorHandle], n_workers: int, timeout: float) -> None:
    """Until every router has registered ``n_workers`` workers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(len(w) >= n_workers for w in ray.get([r.workers.remote() for r in routers])):
            return
        time.sleep(0.2)
    raise TimeoutError(f"routers did not discover {n_workers} workers in {timeout:.0f} s")


def _named_actors(namespace: str) -> list[str]:
    from ray.util import list_named_actors

    return sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and a["name"].startswith(PREFIX + "-"))


def down(namespace: str = "pdcluster", grace: float = 30.0) -> list[str]:
    """Drain and remove every actor and placement group of the deployment. Returns the removed actor names."""
    names = _named_actors(namespace)
    handles = {n: ray.get_actor(n, namespace=namespace) for n in names}
    serving = {n: h for n, h in handles.items() if n != REGISTRY_NAME and not n.startswith(SLOT_PREFIX)}
    # Nodes first (they deregister, then drain), routers last so in-flight requests can finish.
    nodes = [n for n in serving if not n.startswith(f"{PREFIX}-router-")]
    for batch in (nodes, [n for n in serving if n not in nodes]):
        refs = {n: serving[n].shutdown.remote(grace) for n in batch}
        for n, ref in refs.items():
            try:
                ray.get(ref, timeout=grace + 10)
            except ray.exceptions.RayError as e:
                logger.warning("%s did not shut down cleanly: %s", n, e)
    for h in handles.values():
        ray.kill(h, no_restart=True)
    _remove_groups()
    return names


def _remove_groups() -> None:
    from ray.util import placement_group_table

    for pg_id, info in placement_group_table().items():
        if info.get("name", "").startswith(PREFIX + "-") and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def status(namespace: str = "pdcluster") -> dict[str, object]:
    """Per actor: healthy or the error ``check_health`` raised, plus where it runs."""
    out: dict[str, object] = {}
    for n in _named_actors(namespace):
        if n == REGISTRY_NAME or n.startswith(SLOT_PREFIX):
            continue
        h = ray.get_actor(n, namespace=namespace)
        try:
            ray.get(h.check_health.remote(), timeout=10)
            out[n] = {"healthy": True, **ray.get(h.info.remote(), timeout=10)}
        except (ray.exceptions.RayError, RuntimeError) as e:
            out[n] = {"healthy": False, "error": str(e).splitlines()[0]}
    return out


# -- liveness supervision ----------------------------------------------------------------------------------------

@dataclass
class LivenessTracker:
    """When to restart a node: after ``failures_to_restart`` consecutive failed liveness checks, then not again
    until ``restart_grace_s`` has passed (the restarted node loads its model meanwhile)."""

    failures_to_restart: int = 3
    restart_grace_s: float = 300.0
    failures: dict[str, int] = field(default_factory=dict)
    restarted_at: dict[str, float] = field(default_factory=dict)

    def observe(self, name: str, live: bool, now: float) -> bool:
        """Record one check of ``name``; True when it must be restarted now."""
        if now - self.restarted_at.get(name, -self.restart_grace_s) < self.restart_grace_s:
            return False
        self.failures[name] = 0 if live else self.failures.get(name, 0) + 1
        if self.failures[name] < self.failures_to_restart:
            return False
        self.failures[name] = 0
        self.restarted_at[name] = now
        return True


def supervise_once(names: Iterable[str], probe: Callable[[str], bool], restart: Callable[[str], None],
                   tracker: LivenessTracker, now: float | None = None) -> list[str]:
    """One round: probe every node, restart those the tracker gives up on. Returns the restarted names."""
    at = time.monotonic() if now is None else now
    restarted = [n for n in names if tracker.observe(n, probe(n), at)]
    for n in restarted:
        restart(n)
    return restarted


def _node_names(namespace: str) -> list[str]:
    return [n for n in _named_actors(namespace) if any(n.startswith(f"{PREFIX}-{r}-") for r in NODE_ROLES)]


def probe_node(namespace: str, name: str, timeout: float = 10.0) -> bool:
    """The node actor's ``check_liveness`` (its node's ``/liveness``): False on any failure or timeout."""
    try:
        ray.get(ray.get_actor(name, namespace=namespace).check_liveness.remote(), timeout=timeout)
        return True
    except (ray.exceptions.RayError, RuntimeError, TimeoutError) as e:
        logger.warning("%s is not live: %s", name, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


def restart_node(namespace: str, name: str) -> None:
    """Kill the actor (its node process dies with it); Ray restarts it (max_restarts=-1) with a fresh process."""
    logger.error("%s failed its liveness checks; restarting it", name)
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=False)


def supervise_forever(namespace: str, stop: threading.Event, period_s: float = 10.0,
                      tracker: LivenessTracker | None = None) -> None:
    """Until ``stop``: every ``period_s`` probe every node actor and restart the hung ones."""
    tracker = tracker or LivenessTracker()
    while not stop.wait(period_s):
        supervise_once(_node_names(namespace), lambda n: probe_node(namespace, n),
                       lambda n: restart_node(namespace, n), tracker)
