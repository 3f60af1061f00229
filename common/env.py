"""The one place that reads environment variables. Every variable carries the ``PDCLUSTER_`` prefix, except the
third-party switches read or set here on their owner's terms (``TRITON_INTERPRET``, ``TOKENIZERS_PARALLELISM``)."""

from __future__ import annotations

import os
from pathlib import Path

from common.errors import ConfigError


def cache_dir() -> Path:
    """Where generated default models live (``PDCLUSTER_CACHE_DIR``, default ``~/.cache/pdcluster``)."""
    return Path(os.environ.get("PDCLUSTER_CACHE_DIR", Path.home() / ".cache" / "pdcluster"))


def cluster_token() -> str:
    """The per-cluster secret (``PDCLUSTER_CLUSTER_TOKEN``, or the file named by ``PDCLUSTER_CLUSTER_TOKEN_FILE``,
    e.g. a mounted Kubernetes Secret). "" when unset: there is no default; disaggregated nodes refuse to start."""
    token = os.environ.get("PDCLUSTER_CLUSTER_TOKEN", "")
    path = os.environ.get("PDCLUSTER_CLUSTER_TOKEN_FILE", "")
    if not token and path:
        token = Path(path).read_text().strip()
    return token


def admin_token() -> str:
    """Bearer token of the router's admin surface (``PDCLUSTER_ADMIN_TOKEN``); default: the cluster secret."""
    return os.environ.get("PDCLUSTER_ADMIN_TOKEN", "") or cluster_token()


def api_key() -> str:
    """The router's client API key (``PDCLUSTER_API_KEY``, or the file named by ``PDCLUSTER_API_KEY_FILE``); ""
    when unset: generation is open to whoever reaches the router."""
    key = os.environ.get("PDCLUSTER_API_KEY", "")
    path = os.environ.get("PDCLUSTER_API_KEY_FILE", "")
    return key or (read_secret_file(path, "PDCLUSTER_API_KEY_FILE") if path else "")


def read_secret_file(path: str, name: str) -> str:
    """A secret kept in a file (first line, stripped), so it never appears in a command line; ConfigError when the
    file cannot be read or is empty."""
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"{name} {path}: cannot read it ({e.strerror or e})") from None
    if not text:
        raise ConfigError(f"{name} {path}: the file is empty")
    return text.splitlines()[0].strip()


def log_level() -> str:
    return os.environ.get("PDCLUSTER_LOG_LEVEL", "INFO").upper()


def triton_interpret() -> bool:
    """Triton's own ``TRITON_INTERPRET=1``: kernels run on CPU tensors in its interpreter (tests only: slow)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


TOKENIZE_PRELOAD = "PDCLUSTER_TOKENIZE_PRELOAD"


def tokenize_preload() -> str | None:
    """The model folder whose tokenizer the router's tokenize fork server loads once (``PDCLUSTER_TOKENIZE_PRELOAD``;
    set by the router itself, router/tokenize_pool.py), so each forked worker starts with it loaded."""
    return os.environ.get(TOKENIZE_PRELOAD) or None


def set_tokenize_preload(model_path: str) -> None:
    """Name the tokenizer for fork servers started from now on (they inherit this process's environment)."""
    os.environ.setdefault(TOKENIZE_PRELOAD, model_path)


def serial_tokenizers() -> None:
    """HF ``tokenizers``' own ``TOKENIZERS_PARALLELISM``, unless set: off, so a batch encode runs in the calling
    thread (not handed to the library's thread pool while the caller waits) and a later fork is not warned about."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
