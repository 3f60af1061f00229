"""Where Ray puts each replica: pure functions from (role, replicas, ranks per replica, GPUs) to placement groups
and actor options, so the plan is tested without a cluster.

- Role pinning: a custom resource named after the role (``resources={"prefill": 0.01}``; Ray nodes of that pool
  start with ``--resources '{"prefill": 1}'``) or a node label (``label_selector={"pdcluster.io/role": "prefill"}``).
- A node runs ``ranks`` = tp x dp-size scheduler rank processes on one machine: one bundle per rank (its CPUs, and
  ``gpus_per_rank`` GPUs when there are GPUs), all in ONE STRICT_PACK group per replica. The node actor takes
  bundle 0 (its front and rank 0); a slot actor holds each other bundle and hands its GPUs to the node, so rank r
  runs on bundle r's GPUs (``RankSlot``).
- Replicas of one role go to different machines when they can: with one rank per replica all replicas of a role
  share one SPREAD group, one bundle each; with more, each replica gets its own STRICT_PACK group (Ray places
  groups independently; the replicas still land on role nodes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PinMode = Literal["resources", "labels", "none"]
ROLE_LABEL = "pdcluster.io/role"
ROLE_RESOURCE_AMOUNT = 0.01  # each replica takes 1/100 of the role token: up to 100 replicas per Ray node


@dataclass(frozen=True)
class GroupPlan:
    """One placement group: its bundles and strategy, and which replica sits in which bundle."""

    name: str
    strategy: str  # STRICT_PACK | SPREAD | PACK
    bundles: list[dict[str, float]]
    bundle_label_selector: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class ReplicaPlacement:
    """Replica ``index`` of ``role`` runs in group ``group`` at ``bundle`` (its rank 0's bundle); its other ranks'
    bundles are ``rank_bundles`` (in rank order), each held by a slot actor with the same resources."""

    role: str
    index: int
    group: str
    bundle: int
    resources: dict[str, float] = field(default_factory=dict)
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    rank_bundles: tuple[int, ...] = ()


def rank_bundle(role: str, cpus: float, gpus_per_rank: int, pin: PinMode) -> dict[str, float]:
    bundle: dict[str, float] = {"CPU": cpus}
    if gpus_per_rank:
        bundle["GPU"] = float(gpus_per_rank)
    if pin == "resources":
        bundle[role] = ROLE_RESOURCE_AMOUNT
    return bundle


def plan_role(
    role: str, replicas: int, ranks: int = 1, *, cpus_per_rank: float = 1.0, gpus_per_rank: int = 0,
    pin: PinMode = "resources", prefix: str = "pdcluster",
) -> tuple[list[GroupPlan], list[ReplicaPlacement]]:
    """Placement groups and replica placements of one node role (prefill or decode) whose replicas each run
    ``ranks`` scheduler rank processes (tp x dp-size)."""
    if replicas < 1:
        return [], []
    if ranks < 1:
        raise ValueError(f"a {role} replica needs >= 1 rank, got {ranks}")
    bundle = rank_bundle(role, cpus_per_rank, gpus_per_rank, pin)
    selector = [{ROLE_LABEL: role}] if pin == "labels" else None
    actor_res = {role: ROLE_RESOURCE_AMOUNT} if pin == "resources" else {}
    if ranks == 1:
        group = GroupPlan(f"{prefix}-{role}", "SPREAD", [dict(bundle) for _ in range(replicas)],
                          selector * replicas if selector else None)
        places = [
            ReplicaPlacement(role, i, group.name, i, actor_res, cpus_per_rank, float(gpus_per_rank))
            for i in range(replicas)
        ]
        return [group], places
    groups, places = [], []
    for i in range(replicas):
        g = GroupPlan(f"{prefix}-{role}-{i}", "STRICT_PACK", [dict(bundle) for _ in range(ranks)],
                      selector * ranks if selector else None)
        groups.append(g)
        places.append(ReplicaPlacement(role, i, g.name, 0, actor_res, cpus_per_rank, float(gpus_per_rank),
                                       tuple(range(1, ranks))))
    return groups, places


def actor_label_selector(role: str, pin: PinMode) -> dict[str, str] | None:
    return {ROLE_LABEL: role} if pin == "labels" else None
