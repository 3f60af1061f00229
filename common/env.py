"""The one place that reads environment variables. Every variable carries the ``PDCLUSTER_`` prefix, except the
third-party switches read or set here on their owner's terms (``TRITON_INTERPRET``, ``TOKENIZERS_PARALLELISM``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
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


def api_keys() -> tuple[ClientKey, ...]:
    """The router's client API keys (``PDCLUSTER_API_KEY``: one key; or the key file named by
    ``PDCLUSTER_API_KEY_FILE``); () when unset: generation is open to whoever reaches the router."""
    key = os.environ.get("PDCLUSTER_API_KEY", "")
    path = os.environ.get("PDCLUSTER_API_KEY_FILE", "")
    if key:
        return (ClientKey(key),)
    return read_key_file(path, "PDCLUSTER_API_KEY_FILE") if path else ()


def api_key() -> str:
    """The first of ``api_keys`` ("" when unset): the one key a node's SGLang HTTP port takes."""
    keys = api_keys()
    return keys[0].key if keys else ""


@dataclass(frozen=True)
class ClientKey:
    """One key of an API key file. ``max_priority``: the most urgent priority a request under it may ask for (None:
    the router's ``--max-client-priority``)."""

    key: str
    max_priority: int | None = None


PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # priority travels as a protobuf int32


def read_key_file(path: str, name: str) -> tuple[ClientKey, ...]:
    """An API key file, so no key appears in a command line: one key per line, optionally followed by
    ``max_priority=N``; blank lines and lines starting with ``#`` are skipped. ConfigError (naming the file and
    line) when it cannot be read, holds no key, or a line does not parse."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{name} {path}: cannot read it ({e.strerror or e})") from None
    keys: list[ClientKey] = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        ceiling = None
        for extra in fields[1:]:
            what, _, value = extra.partition("=")
            try:
                ceiling = int(value) if what == "max_priority" else None
            except ValueError:
                ceiling = None
            if ceiling is None or not PRIORITY_RANGE[0] <= ceiling <= PRIORITY_RANGE[1]:
                raise ConfigError(f"{name} {path} line {n}: expected 'KEY' or 'KEY max_priority=N' with N an "
                                  f"integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], got {extra!r} after the key")
        keys.append(ClientKey(fields[0], ceiling))
    if not keys:
        raise ConfigError(f"{name} {path}: the file holds no key")
    if len({k.key for k in keys}) < len(keys):
        raise ConfigError(f"{name} {path}: a key is listed twice")
    return tuple(keys)


def read_secret_file(path: str, name: str) -> str:
    """The first key of an API key file (``read_key_file``)."""
    return read_key_file(path, name)[0].key


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
