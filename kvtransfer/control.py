"""The ZMQ control plane of one manager: one ROUTER it receives on, one DEALER per peer address it sends on.

A single control thread owns every socket. Other threads hand it work through ``send`` (a message to an address)
and ``call_soon`` (a callable run on the control thread), both thread-safe and non-blocking. ``on_message`` and
``on_tick`` run on the control thread (and ``on_drained``, after the messages that arrived together were handled,
where the handlers' batched replies go out); ``on_tick`` returns how long the next one may wait (``tick_s`` while rooms
are open, up to the next heartbeat when idle: an idle rank's control thread wakes once a second, not 50 times) and
``tick_soon`` (any thread) brings the next one forward; an exception in them is logged and the thread goes on (a dead control
thread would hang every room of the rank).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from kvtransfer import auth, messages
from kvtransfer.messages import AnyMessage

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, host: str, port: int, on_message: Callable[[AnyMessage, list[bytes]], None],
                 on_tick: Callable[[], float | None], tick_s: float = 0.02, advertise_host: str = "",
                 on_drained: Callable[[], None] | None = None) -> None:
        self._on_message = on_message
        self._on_drained = on_drained
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._next_tick = 0.0  # control thread only (monotonic time)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{advertise_host or host}:{port}"  # what peers are told; binding may be 0.0.0.0
        self._dealers: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()
        self._outbox: deque[tuple[str, list[bytes]] | Callable[[], None]] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kv-control-{port}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, addr: str, msg: AnyMessage, session: tuple[bytes, int] | None = None) -> None:
        """Queue ``msg`` for the peer whose ROUTER is at ``addr``, sealed with ``(session key, seq)`` when given.
        Delivery is best effort (peer may be gone); messages to one address leave in the order queued."""
        payload = messages.encode(msg)
        self._push((addr, auth.seal(*session, payload) if session is not None else [payload]))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the control thread."""
        self._push(fn)

    def tick_soon(self) -> None:
        """Run ``on_tick`` on the control thread before its next wait (a room was opened: its deadlines and
        retries need the short tick from now on)."""
        self._push(self._tick_now)

    def _tick_now(self) -> None:
        self._next_tick = 0.0

    def forget(self, addr: str) -> None:
        """Close the DEALER to ``addr`` (the peer is gone); a later send reconnects."""
        self.call_soon(lambda: self._close_dealer(addr))

    def close(self) -> None:
        with self._lock:
            self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(5)
        for addr in list(self._dealers):
            self._close_dealer(addr)
        self._router.close(0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    def _push(self, item: tuple[str, list[bytes]] | Callable[[], None]) -> None:
        with self._lock:
            if self._stopping:
                return
            # One wake-up per batch: a non-empty outbox has one pending (its first item's), and the control thread
            # itself looks at the outbox before it polls again.
            wake = not self._outbox and threading.get_ident() != self._thread.ident
            self._outbox.append(item)
        if wake:
            self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            # work queued by this thread's own handlers runs before the next wait (it sent no wake-up)
            timeout_ms = 0.0 if self._outbox else max(0.0, (self._next_tick - time.monotonic()) * 1000)
            ready = dict(poller.poll(timeout_ms))
            if self._wake_r.fileno() in ready:
                self._drain_wake()
            with self._lock:
                if self._stopping:
                    return
                work = list(self._outbox)
                self._outbox.clear()
            for item in work:
                self._guarded(self._do, item)
            if self._router in ready:
                self._receive_all()
                if self._on_drained is not None:
                    self._guarded(self._on_drained)
            if time.monotonic() >= self._next_tick:
                wait = self._guarded(self._on_tick)
                wait = min(max(wait, self._tick_s), 1.0) if isinstance(wait, float | int) else self._tick_s
                self._next_tick = time.monotonic() + wait

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            body = frames[1:]  # after the DEALER's identity: [payload] or [payload, seq, mac]
            if len(body) not in (1, 3):
                log.warning("control %s: dropped a message of %d frames", self.address, len(body))
                continue
            try:
                msg = messages.decode(body[0])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("control %s: dropped an undecodable message (%s)", self.address, exc)
                continue
            self._guarded(self._on_message, msg, body)

    def _do(self, item: tuple[str, list[bytes]] | Callable[[], None]) -> None:
        if callable(item):
            item()
            return
        addr, frames = item
        dealer = self._dealers.get(addr)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 100_000)
            dealer.connect(addr)
            self._dealers[addr] = dealer
        try:
            dealer.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("control %s: queue to %s is full; message dropped (peer unresponsive)", self.address, addr)

    def _close_dealer(self, addr: str) -> None:
        dealer = self._dealers.pop(addr, None)
        if dealer is not None:
            dealer.close(0)

    @staticmethod
    def _guarded(fn: Callable, *args: object) -> object:
        try:
            return fn(*args)
        except Exception:  # logged, not swallowed: one bad message must not kill the control thread
            log.exception("kv control thread: handler failed")
            return None
