"""The ``ucx`` backend's prefill side toward one decode peer (loop thread only): ``Target``, the peer as its endpoint
describes it, and ``Connection``, the endpoints opened to it and the remote keys unpacked on them, which carry one
job's PUTs and the flush that ends it.

Invariant: ``Connection.flush`` returns only once every PUT of the job is in the peer's memory; on any other exit
(error, cancellation) the endpoint is dropped first and the flush request waited for, so no PUT is left in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ucxx

from kvtransfer.backends import ucp_rma as ucp
from kvtransfer.backends import wire
from kvtransfer.backends.base import PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.onesided import RemotePool
from kvtransfer.backends.ucx_runtime import CALL_TIMEOUT_S
from kvtransfer.backends.workers import TransferError

SPIN_POLLS = 2000  # flush polls before backing off to short sleeps (a TCP transfer would hold a core otherwise)
BACKOFF_S = 0.0002


@dataclass
class Target:
    """A decode peer as its endpoint describes it (prefill side)."""

    info: PeerInfo
    pool: RemotePool
    rkeys: list[bytes]
    # Why this pairing's connection broke (sticky; later jobs fail at once naming it). Kept on the pairing, not the
    # key: a peer removed and added again (it handshook again after losing this rank) has the same key, and a job of
    # the old pairing that ends late must not break the new one.
    broken: str | None = None


@dataclass
class Connection:
    """Prefill: the endpoints to a decode peer and the remote keys unpacked on the data one (loop thread only).

    ``ep`` (through decode's listener, peer-failure error handling) carries the handshake and ends when either side
    drops the peer; a job fails if it is closed once its flush completed. ``data`` (from decode's worker address,
    no peer-failure error handling, ``ucp.Endpoint``) carries the PUTs: libucx 1.21's cma has no peer-failure
    support, so an endpoint with it (every listener endpoint) gets no cma lane and PUTs go over tcp/lo
    (UCX_PROTO_INFO), slower than NIXL's cma single-copy WRITE on one host. It has an error callback all the
    same: a PUT into a decode process that just died fails the endpoint and the job (without one, UCX aborted the
    prefill process); a decode that dies silently fails the flush or the job's deadline aborts it."""

    ep: Any
    target: Target
    data: ucp.Endpoint | None = None
    rkeys: list[ucp.RemoteKey] = field(default_factory=list)

    @classmethod
    async def open(cls, target: Target, local: PeerKey, connect_timeout_s: float,
                   wanted: Callable[[], bool]) -> Connection:
        """Connect to ``target``'s listener, introduce this rank (``DataHello``), then open the data endpoint and
        unpack the remote keys, unless ``wanted()`` says the pairing is gone meanwhile (TransferError)."""
        ep = await ucxx.create_endpoint(target.info.endpoint["host"], int(target.info.endpoint["port"]),
                                       connect_timeout=connect_timeout_s)
        conn = cls(ep, target)
        try:
            await ep.send_obj(wire.encode(wire.DataHello(local.instance_id, local.epoch)))
            if not wanted():
                raise TransferError("peer removed")
            conn.data = ucp.Endpoint(bytes.fromhex(target.info.endpoint["worker"]))
            conn.rkeys = [ucp.RemoteKey(conn.data.handle, packed) for packed in target.rkeys]
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        """Abort the endpoints (the remote keys destroyed first)."""
        for rkey in self.rkeys:
            rkey.destroy()
        if self.data is not None:
            self.data.close(CALL_TIMEOUT_S)
        self.ep.abort()

    def put(self, job: TransferJob, segments: tuple[np.ndarray, ...]) -> None:
        """One PUT per segment (``onesided.write_segments``: buffer-major, as many per buffer)."""
        src, dst, length = (a.tolist() for a in segments)
        per_buffer = len(src) // len(self.rkeys)
        assert self.data is not None and self.data.handle is not None
        ep, rkeys = self.data.handle, [k.handle for k in self.rkeys]
        for i, (s, d, n) in enumerate(zip(src, dst, length, strict=True)):
            status = ucp.put(ep, s, n, d, rkeys[i // per_buffer])
            if status < 0:
                raise TransferError(f"PUT to {job.peer.instance_id} failed: {ucp.describe(status)}")

    async def flush(self, job: TransferJob, drop: Callable[[], None]) -> None:
        """Until every PUT on this connection is in the peer's memory; on any exit before that (error, cancellation)
        ``drop`` aborts the endpoint and the flush request is waited for, so no PUT of the job is left in flight."""
        try:
            assert self.data is not None and self.data.handle is not None
            req = ucp.flush(self.data.handle)
        except ucp.UcpError as exc:
            raise TransferError(f"flush to {job.peer.instance_id}: {exc}") from exc
        if req is None:
            return
        try:
            polls = 0
            while (status := ucp.status(req)) == ucp.UCS_INPROGRESS:
                ucp.progress()
                polls += 1
                await asyncio.sleep(0 if polls < SPIN_POLLS else BACKOFF_S)
            if status != ucp.UCS_OK:
                raise TransferError(f"WRITE of room {job.room} to {job.peer.instance_id} failed: "
                                    f"{ucp.describe(status)}")
            if self.ep.closed:  # decode dropped this prefill rank: what it wrote may have landed after that
                raise TransferError(f"connection to {job.peer.instance_id} closed by the peer")
        finally:
            if ucp.status(req) == ucp.UCS_INPROGRESS:  # cancelled: abort, then let the request finish
                drop()
                end = time.monotonic() + CALL_TIMEOUT_S
                while ucp.status(req) == ucp.UCS_INPROGRESS and time.monotonic() < end:
                    ucp.progress()
            ucp.release(req)
