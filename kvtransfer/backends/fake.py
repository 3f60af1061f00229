"""``fake``: moves nothing and reports every job done (warm-up, tests of everything but the bytes)."""

from __future__ import annotations

from kvtransfer.backends.base import TransferJob
from kvtransfer.backends.workers import QueuedBackend


class FakeBackend(QueuedBackend):
    transport = "fake"

    def endpoint(self) -> dict[str, str]:
        return {}

    def _move(self, job: TransferJob) -> None:
        pass
