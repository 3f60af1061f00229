"""``FileStorage``: one file per page record under a directory (``file_path`` of the extra config; default
``<PDCLUSTER_CACHE_DIR>/hicache``), shared by every node that names the same directory (a local or network disk).

Files are written to a temporary name and renamed, so a reader sees a whole record or none.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from common.engine.mem.hicache.storage.base import StorageBackend
from common.errors import ConfigError
from common.hicache_flags import StorageOptions


class FileStorage(StorageBackend):
    def __init__(self, options: StorageOptions) -> None:
        self.root = options.file_path
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"hicache file storage: cannot create {self.root} ({e}); set file_path in "
                              "--hicache-storage-backend-extra-config") from None
        if not os.access(self.root, os.W_OK):
            raise ConfigError(f"hicache file storage: {self.root} is not writable; set file_path in "
                              "--hicache-storage-backend-extra-config")

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.kv"

    def get(self, key: str) -> bytearray | None:
        try:
            with open(self.path(key), "rb", buffering=0) as f:
                record = bytearray(os.fstat(f.fileno()).st_size)
                return record if f.readinto(record) == len(record) else None
        except FileNotFoundError:
            return None

    def set(self, key: str, record: bytes) -> bool:
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            tmp.write_bytes(record)
            os.replace(tmp, path)
            return True
        except OSError:
            tmp.unlink(missing_ok=True)
            return False

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def remove(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)
