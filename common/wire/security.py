"""Cluster secret handling shared by every process: generation (``up``, Ray), the start-up requirement, and the
bearer-credential check of gRPC metadata. Key derivation and message MACs of the KV control plane live with
the KV transfer layer (its ``auth`` module), which builds on this secret."""

from __future__ import annotations

import hmac
import secrets

from common import env
from common.errors import ConfigError

CLUSTER_TOKEN_ENV = "PDCLUSTER_CLUSTER_TOKEN"
MIN_TOKEN_CHARS = 16


def generate_cluster_token() -> str:
    """A fresh per-cluster secret (256 bits, hex)."""
    return secrets.token_hex(32)


def require_cluster_token(mode: str) -> str:
    """The cluster secret a node in ``mode`` needs; raises ConfigError saying how to set it when it is missing."""
    token = env.cluster_token()
    if mode != "null" and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"--disaggregation-mode {mode} needs the cluster secret: set {CLUSTER_TOKEN_ENV} (or "
            f"{CLUSTER_TOKEN_ENV}_FILE) to the same value of >= {MIN_TOKEN_CHARS} characters on every node and the "
            "router (`pdcluster up` and `pdcluster ray up` generate one; on Kubernetes create the "
            "pdcluster-cluster-secret Secret)")
    return token


def same_secret(presented: str | bytes, expected: str | bytes) -> bool:
    """Constant-time comparison; an empty expected value never matches."""
    a = presented.encode() if isinstance(presented, str) else presented
    b = expected.encode() if isinstance(expected, str) else expected
    return bool(b) and hmac.compare_digest(a, b)
