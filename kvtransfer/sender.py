"""``KVSender``: the prefill scheduler's handle on one request's KV transfer; the room logic behind it is
``prefill_rooms.PrefillRooms``.

Sender lifecycle::

    Bootstrapping --(TransferInfo from every decode rank this rank serves)--> WaitingForInput
      --send(chunk)--> Transferring --(last chunk's jobs done, final ChunkDone sent, decode confirmed)--> Success
    any non-final state --(deadline, transfer error, peer lost, abort either side)--> Failed
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.handle import KVHandle
from kvtransfer.manager import KVManager
from kvtransfer.metadata import MetadataRecord
from kvtransfer.prefill_rooms import PrefillRooms, SendRoom


class KVSender(KVHandle[PrefillRooms]):
    """The prefill scheduler's handle on one request's transfer. Every method is non-blocking."""

    def __init__(self, mgr: KVManager, bootstrap_room: int) -> None:
        super().__init__(mgr, bootstrap_room, PrefillRooms)
        self._rec: SendRoom = self._rooms.create(bootstrap_room)

    def init(self, num_pages: int, metadata_slot: int | None = None) -> None:
        """Declare the request's total page count (must equal what decode allocated) and its metadata slot."""
        self._rooms.init(self._rec, num_pages, metadata_slot)

    def send(self, page_indices: Sequence[int], last: bool = False, metadata: MetadataRecord | None = None) -> None:
        """Queue one chunk's pages (page numbers, in token order). The last chunk carries the metadata record."""
        self._rooms.send(self._rec, page_indices, last, metadata)
