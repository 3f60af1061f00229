"""Storage backends of the hierarchical cache's third tier (``--hicache-storage-backend``): one table, name -> class,
imported lazily (a node without a storage tier never loads Mooncake)."""

from __future__ import annotations

import importlib

from common.engine.mem.hicache.storage.base import StorageBackend
from common.hicache_flags import StorageOptions

BACKENDS = {
    "file": "common.engine.mem.hicache.storage.file:FileStorage",
    "mooncake": "common.engine.mem.hicache.storage.mooncake:MooncakeStorage",
}


def open_backend(options: StorageOptions) -> StorageBackend:
    module, _, name = BACKENDS[options.backend].partition(":")
    backend: StorageBackend = getattr(importlib.import_module(module), name)(options)
    return backend


__all__ = ["BACKENDS", "StorageBackend", "open_backend"]
