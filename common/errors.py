"""Typed errors. Each maps to one gRPC status / HTTP code at the service boundary."""

from __future__ import annotations

import enum
import logging


class ErrorCode(enum.StrEnum):
    """The gRPC status a node fails a request with, chosen where the failure happens (never guessed from a message's
    wording). Each value is the ``grpc.StatusCode`` member of the same name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the client's request is malformed or can never fit
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # the cluster refused the pairing (KV layout, cluster secret)
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # over the node's queue limit; retry later
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # a deadline passed (a KV room's state, a request's)
    CANCELLED = "CANCELLED"  # aborted: by the client, a scheduler, or the KV peer's abort
    UNAVAILABLE = "UNAVAILABLE"  # a peer or rank died, went silent, or the transport failed
    INTERNAL = "INTERNAL"  # a bug or broken invariant in this node

    @property
    def log_level(self) -> int:
        """How a failure with this code is logged: a cancel is the client's choice (or its abort's echo on the KV
        peer), INFO; every other failure, WARNING."""
        return logging.INFO if self is ErrorCode.CANCELLED else logging.WARNING


class PdclusterError(Exception):
    """Base of every error pdcluster raises on purpose."""


class InvalidRequestError(PdclusterError, ValueError):
    """The request is malformed; the message names the field and what to fix (INVALID_ARGUMENT / HTTP 400)."""


class CapacityError(PdclusterError):
    """The request can never fit this server (prompt over context or KV capacity) (INVALID_ARGUMENT / HTTP 400)."""


class ModelLoadError(PdclusterError):
    """The model folder is unusable: missing files, unknown architecture, bad config."""


class ConfigError(PdclusterError, ValueError):
    """A server flag or flag combination is invalid."""


# A node's failure that is its KV transfer peer's fault (the peer died, went silent, refused or broke the
# transfer) travels as this trailing metadata on the failing RPC, so the router charges the peer's circuit
# breaker, not the node's that only reported it.
FAULT_METADATA_KEY = "pdcluster-fault"
KV_PEER_FAULT = "kv-peer"


def internal_error_message(exc: Exception) -> str:
    """What a request failed by an unexpected error of this process is told (the process keeps serving)."""
    return f"internal error while handling the request ({type(exc).__name__}: {exc}); the server keeps serving"
