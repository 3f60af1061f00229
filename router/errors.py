"""Router errors and their one mapping to gRPC status codes and HTTP statuses."""

from __future__ import annotations

import re

import grpc

from common.errors import CapacityError, InvalidRequestError, PdclusterError

# What node and gRPC messages may carry that a client must not learn: addresses (``ipv4:10.0.0.7:30000``,
# ``[fd00::1]:8998``, ``decode-0.pd.svc:30000``, ``localhost:30000``) and filesystem paths (``/models/x/config.json``).
_ADDRESS = re.compile(
    r"(?:\b(?:ipv4|ipv6|unix|dns|tcp|https?|grpc):(?://)?)?"
    r"(?:\[[0-9A-Fa-f:.%]+\](?::\d{1,5})?"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"
    r"|\b[A-Za-z][\w-]*(?:\.[\w-]+)*:\d{2,5}\b)"
)
_PATH = re.compile(r"(?<![\w./])(?:~|\.{1,2})?/(?:[\w.@+-]+/)+[\w.@+-]*")
INTERNAL_ADDRESS = "<internal address>"
INTERNAL_PATH = "<path>"


def scrub_internal(text: str) -> str:
    """``text`` (a node's or gRPC's message) without internal addresses or filesystem paths."""
    # NOTE: paths before addresses ("host:port/a/b" keeps its port out of the path match), and again after
    # ("http://10.0.0.7/a/b" -> "<internal address>/a/b" -> "<internal address><path>").
    text = _ADDRESS.sub(INTERNAL_ADDRESS, _PATH.sub(INTERNAL_PATH, text))
    return _PATH.sub(INTERNAL_PATH, text)


class RouterError(PdclusterError):
    """An error with a gRPC status code. ``str(e)`` is what the client sees: what happened or what to fix, never an
    internal address or path. ``internal`` holds the operator's details (worker addresses, a node's raw message)
    and goes to logs only (``log_text``)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None, internal: str = "") -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.internal = internal

    def log_text(self) -> str:
        return f"{self} [{self.internal}]" if self.internal else str(self)


class UnavailableError(RouterError):
    """No worker can serve the request (none registered, none healthy, or every attempt failed)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineError(RouterError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class OverloadedError(RouterError):
    """The router or every worker that could serve the request is at its limit (RESOURCE_EXHAUSTED / HTTP 429).

    ``retry_after_s``: when the client should try again (HTTP ``Retry-After``, gRPC ``retry-after-ms``).
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float, internal: str = "") -> None:
        super().__init__(message, internal=internal)
        self.retry_after_s = retry_after_s


class LegError(RouterError):
    """One leg (Prefill, Decode or Generate) failed on a worker. ``retryable``: another attempt may succeed.

    ``worker``: the worker's address (routing and logs; the message names its role only). ``retry_after_s``: the
    worker's retry hint when it answered RESOURCE_EXHAUSTED. ``peer_fault``: the worker said the failure was its
    KV transfer peer's (the other leg's worker), not its own.
    """

    def __init__(
        self, message: str, code: grpc.StatusCode, worker: str, retryable: bool, retry_after_s: float | None = None,
        internal: str = "", peer_fault: bool = False,
    ) -> None:
        super().__init__(message, code, internal or f"worker {worker}")
        self.worker = worker
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.peer_fault = peer_fault


# Worker statuses after which a fresh attempt (new room, maybe new pair) can succeed. FAILED_PRECONDITION from a
# node is a refused pairing (KV layouts, cluster secret): the cluster's misconfiguration, never the client's, and
# another pair may match; when none does the client gets 503, not 400.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def status_of(err: BaseException) -> grpc.StatusCode:
    if isinstance(err, InvalidRequestError | CapacityError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(err, RouterError):
        return err.code
    return grpc.StatusCode.INTERNAL


def http_status_of(err: BaseException) -> int:
    return HTTP_STATUS.get(status_of(err), 500)


UNAVAILABLE_RETRY_AFTER_S = 1.0  # a 503's hint: a node that comes back is routable again after a health check or two


def retry_after_of(err: BaseException) -> float | None:
    """Seconds after which a retry may succeed: the hint of a RESOURCE_EXHAUSTED error (429), and for UNAVAILABLE
    (503: no routable worker, every attempt failed) its hint or ``UNAVAILABLE_RETRY_AFTER_S``, so clients back off
    instead of resending at once while a role is down."""
    hint = getattr(err, "retry_after_s", None)
    code = status_of(err)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return hint
    if code == grpc.StatusCode.UNAVAILABLE:
        return hint if hint is not None else UNAVAILABLE_RETRY_AFTER_S
    return None
