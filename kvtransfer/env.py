"""The environment variables the KV transfer layer reads (all ``PDCLUSTER_``-prefixed; read only here)."""

from __future__ import annotations

import os

CLUSTER_TOKEN = "PDCLUSTER_CLUSTER_TOKEN"


def cluster_token() -> str:
    """Shared secret every manager of one cluster presents at the handshake; empty when unset."""
    return os.environ.get(CLUSTER_TOKEN, "")
