"""``GroupedBackend``: a rank whose KV layers fall in groups of different slot geometry (``KVArgs.groups``: the
target's layers, then a STANDALONE draft model's) runs one backend of the configured kind per group, each over its
group's buffers alone, and moves a job as one job per group::

    submit(job)     group g's backend gets job with the head slice of its own heads (``args.group_heads``)
    on_job_done     the job is done once every group's part is: with the first error any part had, else None
    endpoint        group 0's keys as they are, group g's prefixed "g<g>."; a peer's backend g gets its part back
    add_peer        group g's backend sees the peer's group g layout (``KVLayout.group``) and a pairing of its own

Every backend keeps its own contract (one geometry, jobs to one peer in order), so a job's parts complete in
submission order per group and the job completes in order too: its last part to finish follows the earlier jobs'
parts of that group. Both nodes hold the same groups (the handshake compares ``KVLayout.extra``).
"""

from __future__ import annotations

import dataclasses
import re
import threading

from kvtransfer.args import KVArgs, KVTransferConfig, Mode, group_heads
from kvtransfer.backends.base import BackendEvents, KVBackend, PeerInfo, PeerKey, TransferJob

_GROUP_KEY = re.compile(r"g\d+\.")


def prefix(g: int) -> str:
    return f"g{g}." if g else ""


class _Part:
    """Completions of one group's backend, reported to the grouped backend."""

    def __init__(self, owner: GroupedBackend, group: int) -> None:
        self.owner, self.group = owner, group

    def on_job_done(self, job: TransferJob, error: str | None) -> None:
        self.owner.part_done(self.group, job, error)


class GroupedBackend(KVBackend):
    def __init__(self, args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents, local: PeerKey,
                 cls: type[KVBackend]) -> None:
        super().__init__(args, config, mode, events, local)
        self.group_args = [args.group_args(g) for g in range(len(args.groups()))]
        self.parts: list[KVBackend] = []
        self._lock = threading.Lock()
        # (peer, room, chunk) -> [the whole job, parts still moving, first error]
        self._pending: dict[tuple[PeerKey, int, int], list] = {}
        try:
            for g, a in enumerate(self.group_args):
                self.parts.append(cls(a, config, mode, _Part(self, g), local))
        except BaseException:
            self.close()
            raise

    def endpoint(self) -> dict[str, str]:
        return {prefix(g) + k: v for g, part in enumerate(self.parts) for k, v in part.endpoint().items()}

    def add_peer(self, peer: PeerInfo) -> None:
        for g, part in enumerate(self.parts):
            p = prefix(g)
            own = {k[len(p):]: v for k, v in peer.endpoint.items()
                   if (k.startswith(p) if g else not _GROUP_KEY.match(k))}
            pairing = f"{peer.pairing}/g{g}" if g and peer.pairing else peer.pairing
            part.add_peer(PeerInfo(peer.key, peer.layout.group(g), own, pairing))

    def remove_peer(self, key: PeerKey) -> None:
        for part in self.parts:
            part.remove_peer(key)

    def submit(self, job: TransferJob) -> None:
        with self._lock:
            self._pending[(job.peer, job.room, job.chunk_id)] = [job, len(self.parts), None]
        total = self.args.total_kv_heads
        for part, a in zip(self.parts, self.group_args, strict=True):
            part.submit(dataclasses.replace(job, heads=group_heads(job.heads, total, a.total_kv_heads)))

    def part_done(self, group: int, job: TransferJob, error: str | None) -> None:
        key = (job.peer, job.room, job.chunk_id)
        with self._lock:
            entry = self._pending.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if error is not None and entry[2] is None:
                entry[2] = f"layer group {group}: {error}" if group else error
            if entry[1]:
                return
            del self._pending[key]
            # NOTE: reported under the lock: the last part of job j+1 cannot report before the last part of job j
            self.events.on_job_done(entry[0], entry[2])

    def cancel_room(self, room: int) -> None:
        for part in self.parts:
            part.cancel_room(room)

    def close(self) -> None:
        for part in self.parts:
            part.close()
