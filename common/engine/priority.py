"""``PriorityRules``: priority scheduling's rules (--enable-priority-scheduling), shared by the schedule policy and
the roles' queues (bootstrap, prealloc, transfer)."""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.errors import InvalidRequestError

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.req import Req


class PriorityRules:
    """Priority scheduling's rules, shared by the scheduler and the roles' queues (prealloc, transfer, bootstrap)."""

    def __init__(self, args: ServerArgs) -> None:
        self.priority_on = args.enable_priority_scheduling
        self.sign = 1 if args.schedule_low_priority_values_first else -1
        self.threshold = args.priority_scheduling_preemption_threshold

    def resolve_priority(self, priority: int | None) -> int:
        """The priority a new request runs with; raises if it carries one this node does not schedule by."""
        if priority is not None and not self.priority_on:
            raise InvalidRequestError(
                "priority is set but this node runs without priority scheduling; send the request without "
                "'priority' or start the node with --enable-priority-scheduling")
        if priority is not None:
            return priority
        if not self.priority_on:
            return 0
        return sys.maxsize if self.sign == 1 else -sys.maxsize - 1  # the least urgent

    def urgency(self, req: Req) -> int:
        """Sort key: smaller is more urgent."""
        return req.priority * self.sign

    def beats(self, waiting: Req, running: Req) -> bool:
        return (self.urgency(running) - self.urgency(waiting)) > self.threshold

    def order_key(self) -> Callable[[Req], int] | None:
        """A queue's sort key under priority scheduling (None without it: arrival order)."""
        return self.urgency if self.priority_on else None

    def queue_by_priority(self, reqs: list[Req]) -> dict[str, int]:
        """Requests per priority class (the priority value; 'none' for those sent without one)."""
        counts: dict[str, int] = defaultdict(int)
        default = self.resolve_priority(None)
        for req in reqs:
            counts["none" if not self.priority_on or req.priority == default else str(req.priority)] += 1
        return dict(counts)
