"""``fake``: moves nothing and reports every job done (warm-up, tests of everything but the bytes)."""

from __future__ import annotations

from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends.base import BackendEvents, KVBackend, PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.workers import PeerWorkers


class FakeBackend(KVBackend):
    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents,
                 local: PeerKey) -> None:
        super().__init__(args, config, mode, events, local)
        self._workers = PeerWorkers(events, lambda job: None, "fake")

    def endpoint(self) -> dict[str, str]:
        return {}

    def add_peer(self, peer: PeerInfo) -> None:
        self._workers.add_peer(peer.key)

    def remove_peer(self, key: PeerKey) -> None:
        self._workers.remove_peer(key, "peer removed")

    def submit(self, job: TransferJob) -> None:
        self._workers.submit(job)

    def cancel_room(self, room: int) -> None:
        self._workers.cancel_room(room)

    def close(self) -> None:
        self._workers.close("backend closed")
