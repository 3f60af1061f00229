"""Typed errors. Each maps to one gRPC status / HTTP code at the service boundary."""

from __future__ import annotations


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
