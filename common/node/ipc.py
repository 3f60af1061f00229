"""ZMQ IPC between a node's front process and its scheduler ranks: msgpack-encoded msgspec messages.

    front --PUSH--> ipc://.../rank{r}.in  --PULL--> scheduler rank r      (SchedulerInput, one per frame)
    front <--PULL-- ipc://.../out         <--PUSH-- every rank            (list[SchedulerOutput] per frame)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from dataclasses import dataclass

import msgspec

from common.io_struct import SchedulerInput, SchedulerOutput

_in_encoder = msgspec.msgpack.Encoder()
_in_decoder = msgspec.msgpack.Decoder(SchedulerInput)
_out_decoder = msgspec.msgpack.Decoder(list[SchedulerOutput])


def encode(msg: object) -> bytes:
    return _in_encoder.encode(msg)


def decode_input(frame: bytes) -> SchedulerInput:
    return _in_decoder.decode(frame)


def decode_outputs(frame: bytes) -> list[SchedulerOutput]:
    return _out_decoder.decode(frame)


@dataclass(frozen=True)
class IpcAddrs:
    base: str

    @classmethod
    def new(cls) -> IpcAddrs:
        base = os.path.join(tempfile.gettempdir(), f"pdcluster-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return cls(base)

    def rank_in(self, dp_rank: int) -> str:
        return f"ipc://{self.base}-rank{dp_rank}.in"

    @property
    def out(self) -> str:
        return f"ipc://{self.base}.out"

    def cleanup(self, dp_size: int) -> None:
        for path in [f"{self.base}.out", *(f"{self.base}-rank{r}.in" for r in range(dp_size))]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
