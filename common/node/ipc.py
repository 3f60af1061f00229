"""ZMQ IPC between a node's front process and its scheduler ranks: msgpack-encoded msgspec messages.

    front --PUSH--> ipc://.../rank{r}.in  --PULL--> scheduler rank r      (SchedulerInput, one per frame)
    front <--PULL-- ipc://.../out         <--PUSH-- every rank            (list[SchedulerOutput] per frame)
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import uuid
from dataclasses import dataclass

import msgspec

from common.engine.io_struct import SchedulerInput, SchedulerOutput

_in_encoder = msgspec.msgpack.Encoder()
_in_decoder = msgspec.msgpack.Decoder(SchedulerInput)
_out_decoder = msgspec.msgpack.Decoder(list[SchedulerOutput])


def encode(msg: object) -> bytes:
    return _in_encoder.encode(msg)


def decode_input(frame: bytes) -> SchedulerInput:
    return _in_decoder.decode(frame)


def decode_outputs(frame: bytes) -> list[SchedulerOutput]:
    return _out_decoder.decode(frame)


_PREFIX = "pdcluster-"
_STALE = re.compile(rf"{_PREFIX}(\d+)-[0-9a-f]{{8}}(-rank\d+\.in|\.out)$")


def sweep_stale(folder: str) -> int:
    """Remove the IPC files of fronts whose process is gone (named by its pid); returns how many. A live pid's
    files stay, whatever process holds that pid now."""
    removed = 0
    with os.scandir(folder) as entries:
        for e in entries:
            m = _STALE.match(e.name)
            if m is None or _pid_alive(int(m.group(1))):
                continue
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(e.path)
                removed += 1
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@dataclass(frozen=True)
class IpcAddrs:
    base: str

    @classmethod
    def new(cls) -> IpcAddrs:
        """Fresh paths in the temp folder; the files a killed front left there (SIGKILL skips ``cleanup``) go."""
        tmp = tempfile.gettempdir()
        sweep_stale(tmp)
        return cls(os.path.join(tmp, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"))

    def rank_in(self, dp_rank: int) -> str:
        return f"ipc://{self.base}-rank{dp_rank}.in"

    @property
    def out(self) -> str:
        return f"ipc://{self.base}.out"

    def cleanup(self, dp_size: int) -> None:
        for path in [f"{self.base}.out", *(f"{self.base}-rank{r}.in" for r in range(dp_size))]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
