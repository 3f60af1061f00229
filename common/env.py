"""The one place that reads environment variables. Every variable carries the ``PDCLUSTER_`` prefix, except the
third-party switches read here on their owner's terms (``TRITON_INTERPRET``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where generated default models live (``PDCLUSTER_CACHE_DIR``, default ``~/.cache/pdcluster``)."""
    return Path(os.environ.get("PDCLUSTER_CACHE_DIR", Path.home() / ".cache" / "pdcluster"))


def cluster_token() -> str:
    """Shared secret that KV-transfer peers must present (``PDCLUSTER_CLUSTER_TOKEN``)."""
    return os.environ.get("PDCLUSTER_CLUSTER_TOKEN", "pdcluster-dev-token")


def log_level() -> str:
    return os.environ.get("PDCLUSTER_LOG_LEVEL", "INFO").upper()


def triton_interpret() -> bool:
    """Triton's own ``TRITON_INTERPRET=1``: kernels run on CPU tensors in its interpreter (tests only: slow)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
