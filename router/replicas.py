"""``pdcluster router --replicas N``: N router processes on the same ports (SO_REUSEPORT).

Routers are stateless replicas (DESIGN §1): each child is a whole router with its own worker view, policies and
metrics; the kernel spreads client connections over them. The parent only starts the children, prints one
``router ready`` line once every child is ready, forwards SIGINT/SIGTERM and exits when they have.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def child_argv(argv: list[str]) -> list[str]:
    """The router's own argv with ``--replicas N`` replaced by one replica that binds with SO_REUSEPORT."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--replicas":
            skip = True
            continue
        if a.startswith("--replicas="):
            continue
        out.append(a)
    return [*out, "--replicas", "1", "--reuse-port"]


def run_replicas(n: int, argv: list[str], ready_timeout_s: float = 120.0) -> int:
    cmd = [sys.executable, "-m", "common.app.cli", *child_argv(argv)]
    children = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(n)]

    def stop(signum: int, _frame: object) -> None:
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    deadline = time.monotonic() + ready_timeout_s
    line = ""
    for c in children:
        assert c.stdout is not None
        while time.monotonic() < deadline:
            line = c.stdout.readline()
            if not line or line.startswith("router ready"):
                break
        if not line.startswith("router ready"):
            stop(signal.SIGTERM, None)
            return 1
    print(f"{line.strip()} replicas={n} pids={','.join(str(c.pid) for c in children)}", flush=True)
    codes = [c.wait() for c in children]
    return max(codes, default=0)
