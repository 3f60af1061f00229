"""The hierarchical cache's flags (SGLang's names): their combinations and ``--hicache-storage-backend-extra-config``.

The flags are fields of ``ServerArgs`` (``common.config``); this module holds their checks, so a bad combination
stops the node before any model loads, and the parsed storage options the cache reads
(``common.engine.mem.hicache``). Every value either works or is refused here:

- every ``--hicache-*`` flag needs ``--enable-hierarchical-cache``, and that needs the radix cache;
- the host pool's size is ``--hicache-size`` or ``--hicache-ratio``, not both;
- a decode node's host tier holds retracted requests' KV (``HiHeldPrefixCache``): it takes the pool's size, layout
  and copy backend, and refuses the write policy and the storage flags (it inserts no finished KV to write);
- the storage flags need ``--hicache-storage-backend``; the extra config is a JSON object of the keys below (the
  prefetch timeouts only with ``--hicache-storage-prefetch-policy timeout``, the one policy that reads them).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import env
from common.errors import ConfigError

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
IO_BACKENDS = ("kernel", "direct")  # kernel: one gather/scatter launch for every layer; direct: torch ops per layer
MEM_LAYOUTS = ("layer_first", "page_first")
STORAGE_BACKENDS = ("file", "mooncake")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
DECODE_REFUSES = ("hicache_write_policy", "hicache_storage_backend", "hicache_storage_prefetch_policy",
                  "hicache_storage_backend_extra_config")  # a decode node inserts no finished KV to write or store

# extra config key -> (type, default, meaning); the defaults are SGLang's.
_COMMON_KEYS: dict[str, tuple[type, Any]] = {
    "prefetch_threshold": (int, 256),  # tokens: a shorter storage hit is not worth a prefetch
    "prefetch_timeout_base": (float, 1.0),  # seconds (policy timeout)
    "prefetch_timeout_per_ki_token": (float, 0.25),  # seconds per 1024 prefetched tokens (policy timeout)
}
_BACKEND_KEYS: dict[str, dict[str, tuple[type, Any]]] = {
    "file": {"file_path": (str, "")},  # default: <PDCLUSTER_CACHE_DIR>/hicache
    "mooncake": {
        "master_server_address": (str, ""),  # HOST:PORT of a running mooncake_master (required)
        "local_hostname": (str, "127.0.0.1"),
        "metadata_server": (str, "P2PHANDSHAKE"),
        "protocol": (str, "tcp"),
        "device_name": (str, ""),
        "global_segment_size": (int, 256 << 20),  # bytes this node lends to the store
        "local_buffer_size": (int, 64 << 20),
    },
}


@dataclass(frozen=True)
class StorageOptions:
    """``--hicache-storage-backend`` and its extra config, parsed and checked."""

    backend: str
    prefetch_policy: str
    prefetch_threshold: int
    prefetch_timeout_base: float
    prefetch_timeout_per_ki_token: float
    backend_config: dict[str, Any]

    @property
    def file_path(self) -> Path:
        return Path(self.backend_config.get("file_path") or env.cache_dir() / "hicache")


def parse_storage_options(backend: str, prefetch_policy: str, extra: str | None) -> StorageOptions:
    flag = "--hicache-storage-backend-extra-config"
    try:
        given = json.loads(extra) if extra else {}
    except ValueError as e:
        raise ConfigError(f"{flag} must be a JSON object: {e}") from None
    if not isinstance(given, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {type(given).__name__}")
    known = {**_COMMON_KEYS, **_BACKEND_KEYS[backend]}
    values: dict[str, Any] = {}
    for key, value in given.items():
        if key not in known:
            raise ConfigError(f"{flag}: unknown key {key!r} for --hicache-storage-backend {backend}; known keys: "
                              f"{', '.join(sorted(known))}")
        kind = known[key][0]
        ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
        if not ok or isinstance(value, bool) or (kind in (int, float) and value < 0):
            raise ConfigError(f"{flag}: {key} must be a non-negative {kind.__name__}, got {value!r}")
        values[key] = value
    timeouts = [key for key in values if key.startswith("prefetch_timeout")]
    if timeouts and prefetch_policy != "timeout":
        raise ConfigError(f"{flag}: {timeouts[0]} is read by --hicache-storage-prefetch-policy timeout only (got "
                          f"{prefetch_policy}); drop it or choose that policy")
    merged = {key: values.get(key, default) for key, (_, default) in known.items()}
    if backend == "mooncake" and not merged["master_server_address"]:
        raise ConfigError(f"--hicache-storage-backend mooncake needs {flag} '{{\"master_server_address\": "
                          "\"HOST:PORT\"}' (a running mooncake_master; the wheel ships one)")
    return StorageOptions(
        backend=backend,
        prefetch_policy=prefetch_policy,
        prefetch_threshold=int(merged.pop("prefetch_threshold")),
        prefetch_timeout_base=float(merged.pop("prefetch_timeout_base")),
        prefetch_timeout_per_ki_token=float(merged.pop("prefetch_timeout_per_ki_token")),
        backend_config=merged,
    )


def check_hicache_flags(args: Any) -> None:
    """Refuse hierarchical-cache flags that would be taken and not used (``ServerArgs.__post_init__``)."""
    given = [f.name for f in dataclasses.fields(args)
             if f.name.startswith("hicache_") and getattr(args, f.name) != f.default]
    if not args.enable_hierarchical_cache:
        if given:
            raise ConfigError(f"{_option(given[0])} needs --enable-hierarchical-cache")
        return
    if args.disable_radix_cache:
        raise ConfigError("--enable-hierarchical-cache extends the radix cache: drop --disable-radix-cache")
    if args.hicache_size and "hicache_ratio" in given:
        raise ConfigError("--hicache-size and --hicache-ratio both size the host pool: give one")
    storage_only = ("hicache_storage_prefetch_policy", "hicache_storage_backend_extra_config")
    if args.hicache_storage_backend is None and any(name in given for name in storage_only):
        name = next(n for n in given if n in storage_only)
        raise ConfigError(f"{_option(name)} needs --hicache-storage-backend")
    if args.disaggregation_mode == "decode":
        prefill_only = [n for n in given if n in DECODE_REFUSES]
        if prefill_only:
            raise ConfigError(
                f"{_option(prefill_only[0])} is for prefill and colocated nodes: a decode node's host tier only "
                "holds the KV of retracted requests (written at retraction, restored when they resume)")
    if args.hicache_storage_backend is not None:
        parse_storage_options(args.hicache_storage_backend, args.hicache_storage_prefetch_policy,
                              args.hicache_storage_backend_extra_config)


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")
