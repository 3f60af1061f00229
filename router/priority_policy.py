"""Priorities under policy: how urgent a client's request may be, checked before the request is tokenized.

    bearer of the request                                   its ceiling
    the admin token (``--admin-token``)                     none
    a key of ``--api-key-file`` with ``max_priority=N``     N
    any other (another key, or none on an open router)      ``--max-client-priority`` (unset: none)

"More urgent" is the nodes' order: a larger value, or a smaller one when the decode (or colocated) nodes run
``--schedule-low-priority-values-first``. A request more urgent than its ceiling is refused (HTTP 400 /
INVALID_ARGUMENT naming the ceiling and where it comes from) or served at the ceiling, as ``--client-priority-over``
says. A request without a priority is the least urgent and is never checked; a priority that is no int32 is left to
``InputProcessor`` to refuse.
"""

from __future__ import annotations

from common.env import PRIORITY_RANGE
from common.errors import InvalidRequestError
from router.client_auth import accepted
from router.config import RouterConfig

FLAG = "the router's --max-client-priority"


class PriorityPolicy:
    def __init__(self, cfg: RouterConfig) -> None:
        self.default = cfg.max_client_priority
        self.clamp = cfg.client_priority_over == "clamp"
        self.admin = (cfg.admin_token,) if cfg.admin_token else ()
        self.keyed = tuple(((k.key,), k.max_priority) for k in cfg.api_keys if k.max_priority is not None)
        self.clamped = 0  # requests served at their ceiling, since start

    @property
    def active(self) -> bool:
        return self.default is not None or bool(self.keyed)

    def ceiling(self, authorization: str | None) -> tuple[int | None, str]:
        """The ceiling of a request carrying ``authorization`` (None: none) and where it comes from."""
        if self.admin and accepted(authorization, self.admin):
            return None, "the admin token"
        own = [c for key, c in self.keyed if accepted(authorization, key)]
        if own:
            return own[0], "this API key's max_priority"
        return self.default, FLAG

    def admit(self, priority: int | None, authorization: str | None, low_values_first: bool) -> int | None:
        """``priority`` as it may be served, or InvalidRequestError when it is over its ceiling and refused."""
        if not self.active or isinstance(priority, bool) or not isinstance(priority, int) \
                or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
            return priority
        ceiling, source = self.ceiling(authorization)
        if ceiling is None or (priority >= ceiling if low_values_first else priority <= ceiling):
            return priority
        if self.clamp:
            self.clamped += 1
            return ceiling
        bound = f">= {ceiling} (smaller values are more urgent on these nodes)" if low_values_first \
            else f"<= {ceiling}"
        raise InvalidRequestError(f"priority {priority} is more urgent than this client may ask for: send priority "
                                  f"{bound}, or none ({source})")
