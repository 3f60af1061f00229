"""``KVReceiver``: the decode scheduler's handle on one request's KV transfer; the room logic behind it is
``decode_rooms.DecodeRooms``.

Receiver lifecycle::

    Bootstrapping --(topology + rank addresses from Bootstrap, handshake with every source rank)--> WaitingForInput
      --(first ChunkDone)--> Transferring --(all chunks from every source + valid metadata)--> Success
    any non-final state --(deadline, Status/Abort from prefill, peer lost, local abort)--> Failed
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.decode_rooms import DecodeRooms, RecvRoom
from kvtransfer.handle import KVHandle
from kvtransfer.manager import KVManager
from kvtransfer.metadata import MetadataRecord
from kvtransfer.poll import KVPoll


class KVReceiver(KVHandle[DecodeRooms]):
    """The decode scheduler's handle on one request's transfer. Every method is non-blocking."""

    def __init__(self, mgr: KVManager, bootstrap_room: int, bootstrap_addr: str) -> None:
        super().__init__(mgr, bootstrap_room, DecodeRooms)
        self._rec: RecvRoom = self._rooms.create(bootstrap_room, bootstrap_addr)

    def init(self, prefill_dp_rank: int) -> None:
        """Resolve the prefill rank(s) holding the KV and handshake with them (in the background)."""
        self._rooms.init(self._rec, prefill_dp_rank)

    def send_metadata(self, page_indices: Sequence[int], metadata_slot: int) -> None:
        """Destination page numbers (token order) and the metadata slot; sent to prefill once it is resolved. Page 0
        (the padding page) marks a page this rank holds already: prefill moves nothing for it."""
        self._rooms.send_metadata(self._rec, page_indices, metadata_slot)

    def metadata(self) -> MetadataRecord:
        """The record prefill delivered (valid after Success; its room is this room)."""
        if self._rec.state != KVPoll.Success or self._rec.metadata_slot is None:
            raise RuntimeError(f"room {self.room}: metadata read in state {self._rec.state.name}")
        return self._mgr.metadata.read(self._rec.metadata_slot)
