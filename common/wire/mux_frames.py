"""Framing shared by both ends of a ``Worker.Mux`` stream: batched writes, fragmentation, reassembly.

Invariants: messages of one stream_id are written in the order they were queued; a message over
``FRAGMENT_BYTES`` goes out as fragments of at most that size, one fragment of each large message per frame, so a
small message of another stream queued behind a large one waits for at most one fragment per large message in
flight, never for the whole large message; what its own stream queues behind it goes out after its last fragment
(one item per frame). One frame carries everything small that was queued when the writer woke (up to
``FRAME_BYTES``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from pdcluster.v1 import worker_pb2

logger = logging.getLogger(__name__)

MUX_METADATA_KEY = "pdcluster-mux"  # in the initial metadata of every Mux stream a node serves
FRAGMENT_BYTES = 128 << 10  # a message larger than this is sent in pieces of this size
FRAME_BYTES = 1 << 20  # a frame stops taking small messages past this (under every gRPC receive limit)
MAX_FRAGMENTS = FRAME_BYTES // FRAGMENT_BYTES - 1  # per frame, leaving room for small messages


class FrameWriter:
    """Queue messages from any task on the loop; one writer task sends them as batched ``MuxFrame`` writes."""

    def __init__(self, write: Callable[[worker_pb2.MuxFrame], Awaitable[None]], on_error: Callable[[BaseException], None]):
        self._write = write
        self._on_error = on_error
        self._small: deque[tuple[worker_pb2.MuxMessage, int]] = deque()
        self._large: deque[deque[worker_pb2.MuxMessage]] = deque()  # per large message, its remaining fragments
        # stream_id -> its lane in _large: a large message's fragments still to go, then what its stream queued after
        self._lanes: dict[int, deque[worker_pb2.MuxMessage]] = {}
        self._wake = asyncio.Event()
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    def send(self, msg: worker_pb2.MuxMessage) -> None:
        if self._closed:
            return
        size = msg.ByteSize()
        sid = msg.stream_id
        lane = self._lanes.get(sid)
        if size <= FRAGMENT_BYTES:
            if lane is None:
                self._small.append((msg, size))
            else:
                lane.append(msg)  # behind its stream's large message
        else:
            data = msg.SerializeToString()
            pieces = (
                worker_pb2.MuxMessage(
                    stream_id=sid,
                    fragment=worker_pb2.MuxFragment(
                        data=data[i : i + FRAGMENT_BYTES], more=i + FRAGMENT_BYTES < len(data)
                    ),
                )
                for i in range(0, len(data), FRAGMENT_BYTES)
            )
            if lane is None:
                self._large.append(self._lanes.setdefault(sid, deque(pieces)))
            else:
                lane.extend(pieces)
        self._wake.set()

    def send_first(self, msg: worker_pb2.MuxMessage) -> None:
        """Queue a small message ahead of the small ones already queued (a keepalive's answer)."""
        if not self._closed:
            self._small.appendleft((msg, msg.ByteSize()))
            self._wake.set()

    async def _run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                await asyncio.sleep(0)  # let the tasks made ready in this loop iteration queue theirs too
                self._wake.clear()
                while self._small or self._large:
                    frame = worker_pb2.MuxFrame()
                    out = frame.messages
                    budget = FRAME_BYTES
                    for _ in range(min(len(self._large), MAX_FRAGMENTS)):  # one item of each lane, rotating
                        pieces = self._large.popleft()
                        item = pieces.popleft()
                        out.append(item)
                        budget -= FRAGMENT_BYTES
                        if pieces:
                            self._large.append(pieces)
                        else:
                            del self._lanes[item.stream_id]
                    small = self._small
                    while small and budget >= small[0][1]:
                        msg, size = small.popleft()
                        out.append(msg)
                        budget -= size + 8
                    await self._write(frame)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the stream broke: the owner fails what it carried
            self._closed = True
            self._on_error(e)

    def close(self) -> None:
        self._closed = True
        self._small.clear()
        self._large.clear()
        self._lanes.clear()
        self._task.cancel()


class Reassembler:
    """Turns received messages back into whole ones: fragments are buffered per stream_id until the last."""

    def __init__(self) -> None:
        self._parts: dict[int, list[bytes]] = {}

    def whole(self, msg: worker_pb2.MuxMessage) -> worker_pb2.MuxMessage | None:
        """``msg`` itself, the message its fragment completes, or None while pieces are outstanding."""
        if msg.WhichOneof("kind") != "fragment":
            return msg
        parts = self._parts.setdefault(msg.stream_id, [])
        parts.append(msg.fragment.data)
        if msg.fragment.more:
            return None
        del self._parts[msg.stream_id]
        return worker_pb2.MuxMessage.FromString(b"".join(parts))

    def forget(self, stream_id: int) -> None:
        self._parts.pop(stream_id, None)
