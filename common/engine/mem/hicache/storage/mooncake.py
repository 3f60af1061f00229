"""``MooncakeStorage``: page records in a Mooncake store (``mooncake.store.MooncakeDistributedStore``, from the
mooncake-transfer-engine wheels). Works on CPU over TCP with peers found by P2P handshake: what it needs is a
running ``mooncake_master`` (the wheel ships the binary; ``master_server_address`` in the extra config). Each node
lends ``global_segment_size`` bytes of its memory to the store; the store's data lives in the nodes' segments.
"""

from __future__ import annotations

import socket

from common.engine.mem.hicache.storage.base import StorageBackend
from common.errors import ConfigError
from common.hicache_flags import StorageOptions

CONNECT_TIMEOUT_S = 5.0


class MooncakeStorage(StorageBackend):
    def __init__(self, options: StorageOptions) -> None:
        cfg = options.backend_config
        master = cfg["master_server_address"]
        host, _, port = master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError) as e:  # the store's setup would block on an unreachable master
            raise ConfigError(f"hicache mooncake storage: no mooncake_master at {master} ({e}); start one "
                              "(mooncake_master --rpc_port PORT) or fix master_server_address") from None
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup(cfg["local_hostname"], cfg["metadata_server"], cfg["global_segment_size"],
                              cfg["local_buffer_size"], cfg["protocol"], cfg["device_name"], master)
        if rc != 0:
            raise ConfigError(f"hicache mooncake storage: setup against {master} failed (code {rc}); check "
                              "--hicache-storage-backend-extra-config")

    def get(self, key: str) -> bytearray | None:
        data = self.store.get(key)
        return bytearray(data) if data else None

    def set(self, key: str, record: bytes) -> bool:
        return self.store.put(key, record) == 0

    def exists(self, key: str) -> bool:
        return self.store.is_exist(key) == 1

    def remove(self, key: str) -> None:
        self.store.remove(key)  # a record under its lease stays until the lease ends (a later read misses again)

    def close(self) -> None:
        self.store.close()
