"""Supervision of ``pdcluster up``'s children (router and nodes): a child that exits while the cluster is up is
reported (exit code and the tail of its log) and started again with the same command line - the same ports and
flags - after a backoff, while the other children keep serving.

One child's states::

    running --exits--> backoff --due--> running        (while restarts < max_restarts)
                   \\--> given up                       (restarts == max_restarts: stays down, reported once)

Backoff: ``backoff_s`` doubling per restart up to ``backoff_max_s``. A child that stayed up ``stable_s`` is
healthy again: its restart count (and so its backoff) resets. ``max_restarts`` therefore caps a crash loop, not
the restarts over a cluster's lifetime.

The supervisor never waits: ``poll`` looks at every child once and starts the restarts that are due; its caller
owns the loop and the stop. A node restarted on its old address is found again by the router's health monitor
(its next successful probe marks it healthy) and by its KV peers (a new start is a new epoch, kvtransfer/manager.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LOG_TAIL_CHARS = 3000


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts in a row (none up stable_s) before up gives up on the child; 0: never
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")

    def delay(self, restarts: int) -> float:
        """Backoff before restart number ``restarts + 1``."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** min(restarts, 30))


@dataclass
class Child:
    """One supervised process: its command line, environment and log are fixed; ``proc`` is its current start."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    grpc_port: int
    metrics_port: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0  # restarts in a row since the child was last up stable_s
    restart_at: float | None = None  # set while in backoff
    given_up: bool = False
    affinity: tuple[int, ...] | None = None  # CPU cores of the process (its children inherit them); None: any

    def launch(self) -> None:
        """Start (or start again) the process; its output is appended to ``log``. Its own session, so a stop or a
        cleanup signals its whole process group (the node's rank processes too)."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=self.env)
        if self.affinity is not None:
            # NOTE: Popen returns once the child has exec'd; its interpreter is still starting up (imports take tens of
            # ms) and has no other thread or child process yet, so all of them inherit the mask. A child that is
            # gone already is the supervisor's to see.
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(self.proc.pid, self.affinity)
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def exit_code(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def terminate(self) -> None:
        """SIGTERM the current process if it still runs (its graceful stop)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Until the current process exits or ``timeout`` passes."""
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)

    def kill_group(self) -> None:
        """SIGKILL what is left of the child's process group (ranks orphaned by a killed node front)."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, children: list[Child], policy: RestartPolicy,
                 report: Callable[[str], None] = _report) -> None:
        self.children = children
        self.policy = policy
        self.report = report

    def poll(self, now: float | None = None) -> None:
        """One pass: notice exits, schedule restarts, start the due ones. Never blocks beyond a ``Popen``."""
        now = time.monotonic() if now is None else now
        for child in self.children:
            if child.given_up:
                continue
            if child.restart_at is None:
                self._check(child, now)
            elif now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                child.launch()
                self.report(f"{child.name} restarted: pid {child.pid} (restart {child.restarts} of "
                            f"{self.policy.max_restarts} in a row)")

    def _check(self, child: Child, now: float) -> None:
        up_for = now - child.started_at
        if up_for >= self.policy.stable_s:
            child.restarts = 0
        code = child.exit_code()
        if code is None:
            return
        child.kill_group()
        head = f"{child.name} (pid {child.pid}) exited with code {code} after {up_for:.1f} s"
        if child.restarts >= self.policy.max_restarts:
            child.given_up = True
            self.report(f"{head}; giving up on it after {child.restarts} restarts in a row (--max-restarts "
                        f"{self.policy.max_restarts}); its log {child.log} ends:\n{child.tail()}")
            return
        delay = self.policy.delay(child.restarts)
        child.restart_at = now + delay
        self.report(f"{head}; restarting it in {delay:.1f} s; its log {child.log} ends:\n{child.tail()}")

    def given_up(self, name: str) -> bool:
        return any(c.given_up for c in self.children if c.name == name)
