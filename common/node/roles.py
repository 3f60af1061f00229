"""The one table from ``--disaggregation-mode`` to what the role plugs into a node: the ``SchedulerRole`` handed
to each rank's ``Scheduler``, the gRPC servicer of the front, and extra services (the prefill node's Bootstrap).
Entries are ``module:name`` references (``common.refs``), so ``common`` imports no role package."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.config import ServerArgs
from common.refs import load_ref

if TYPE_CHECKING:  # the front reads this table and must not import the engine (torch)
    from common.engine.scheduler_role import SchedulerRole


@dataclass(frozen=True)
class RoleSpec:
    role_ref: str  # "module:Class" of a SchedulerRole, built as Class(args) inside each rank process
    servicer_ref: str  # "module:Class", a WorkerServicer subclass
    extra_services: str | None = None  # "module:function(args, servicer) -> awaitable cleanup", optional


ROLES: dict[str, RoleSpec] = {
    "null": RoleSpec("common.engine.scheduler_role:ColocatedRole", "common.node.front:WorkerServicer"),
    "prefill": RoleSpec("prefill_node.role:PrefillRole", "prefill_node.servicer:PrefillServicer",
                        "prefill_node.servicer:add_bootstrap_service"),
    "decode": RoleSpec("decode_node.role:DecodeRole", "decode_node.servicer:DecodeServicer"),
}


def make_role(args: ServerArgs) -> SchedulerRole:
    """The scheduler role of ``args``'s mode, ready to be handed to a ``Scheduler``."""
    return load_ref(ROLES[args.disaggregation_mode].role_ref)(args)
