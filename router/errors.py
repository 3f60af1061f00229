"""Router errors and their one mapping to gRPC status codes and HTTP statuses."""

from __future__ import annotations

import grpc

from common.errors import CapacityError, InvalidRequestError, PdclusterError


class RouterError(PdclusterError):
    """An error with a gRPC status code; the message tells the client what happened or what to fix."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


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

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LegError(RouterError):
    """One leg (Prefill, Decode or Generate) failed on a worker. ``retryable``: another attempt may succeed.

    ``retry_after_s``: the worker's retry hint when it answered RESOURCE_EXHAUSTED.
    """

    def __init__(
        self, message: str, code: grpc.StatusCode, worker: str, retryable: bool, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message, code)
        self.worker = worker
        self.retryable = retryable
        self.retry_after_s = retry_after_s


# Worker statuses after which a fresh attempt (new room, maybe new pair) can succeed.
RETRYABLE = frozenset(
    {
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


def retry_after_of(err: BaseException) -> float | None:
    """Seconds after which a retry may succeed, for RESOURCE_EXHAUSTED errors that carry a hint."""
    hint = getattr(err, "retry_after_s", None)
    return hint if status_of(err) == grpc.StatusCode.RESOURCE_EXHAUSTED else None
