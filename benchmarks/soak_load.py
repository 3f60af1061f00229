"""The soak's run (``benchmarks/soak.py``): its state (``Soak``), the closed loop of requests and the prober, the faults
it injects, and the RSS samples it takes of every child of ``up``."""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.loadgen.clients import OpenAIClient
from benchmarks.loadgen.stats import RequestResult
from benchmarks.loadgen.workload import RequestSpec, WorkloadConfig, make_workload
from benchmarks.up_runs import UpCluster

RESTART_LINE = re.compile(r"^(\S+) restarted: pid (\d+)", re.M)


@dataclass
class Fault:
    kind: str  # burst | kill | stall
    at_s: float  # planned start, seconds since the load began
    started: float = 0.0
    ended: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Soak:
    args: argparse.Namespace
    cluster: UpCluster
    t0: float = 0.0
    wall0: float = 0.0  # time.time() at t0, to place the children's log lines
    results: list[RequestResult] = field(default_factory=list)
    probes: list[tuple[float, float, bool]] = field(default_factory=list)  # (start, end, ok) since t0
    rss: list[tuple[float, str, int, float]] = field(default_factory=list)  # (t, child, pid, MiB)
    faults: list[Fault] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def pids(self) -> dict[str, int]:
        """Each child's current pid: the one ``up`` printed at start, or its latest restart."""
        pids = dict(self.cluster.children or {})
        pids.update({name: int(pid) for name, pid in RESTART_LINE.findall(self.cluster.log.read_text())})
        return pids

    async def send(self, client: OpenAIClient, spec: RequestSpec, cancel_after: float | None) -> None:
        if cancel_after is None:
            self.results.append(await client.send(spec, self.t0))
            return
        try:
            self.results.append(await asyncio.wait_for(client.send(spec, self.t0), cancel_after))
        except TimeoutError:
            self.results.append(RequestResult(spec.index, spec.kind, 0.0, error="client_cancel"))

    def workload(self) -> list[RequestSpec]:
        """The closed loop's prompts, built before the clock starts (building 100,000 took the whole 30-s window of
        the short soak on a loaded machine, blocking the loop: no request was sent): a few per worker-second, reused
        in order if a fast cluster gets through them."""
        a = self.args
        n = min(100_000, max(1_000, int(a.concurrency * a.duration * 2)))
        return make_workload(WorkloadConfig(kind="mixed", num_requests=n, input_len=a.input_len,
                                            output_len=a.output_len, long_input_len=a.long_len, seed=a.seed))

    async def closed_loop(self, client: OpenAIClient, until: float, specs: list[RequestSpec]) -> None:
        queue = collections.deque(specs)
        rng = random.Random(self.args.seed)

        async def worker() -> None:
            while self.now() < until:
                if not queue:
                    queue.extend(specs)
                cancel = rng.uniform(0.05, 2.0) if rng.random() < self.args.cancel_fraction else None
                await self.send(client, queue.popleft(), cancel)

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))

    async def prober(self, client: OpenAIClient, until: float) -> None:
        """A 2-token probe every 0.5 s, one at a time (a probe is a client like the others: under a saturating load it
        queues like them, so its latency is reported with the recovery figures)."""
        spec = RequestSpec(index=-1, prompt_ids=[101, 102, 103, 104], max_tokens=2, kind="probe")
        while self.now() < until:
            start = self.now()
            try:
                ok = (await asyncio.wait_for(client.send(spec, self.t0), 60)).ok
            except TimeoutError:
                ok = False
            self.probes.append((start, self.now(), ok))
            await asyncio.sleep(max(0.0, 0.5 - (self.now() - start)))

    async def sample_rss(self, until: float) -> None:
        while self.now() < until:
            for name, pid in self.pids().items():
                try:
                    root = psutil.Process(pid)
                    procs = [root, *root.children(recursive=True)]
                    mib = sum(private_rss(p) for p in procs) / 2**20
                except psutil.Error:
                    continue
                self.rss.append((round(self.now(), 2), name, pid, round(mib, 1)))
            await asyncio.sleep(2.0)

    async def inject(self, client: OpenAIClient, fault: Fault) -> None:
        await asyncio.sleep(max(0.0, fault.at_s - self.now()))
        fault.started = self.now()
        pids = self.pids()
        if fault.kind == "burst":
            specs = make_workload(WorkloadConfig(kind="fixed", num_requests=self.args.burst, input_len=16,
                                                 output_len=8, seed=self.args.seed + 1))
            res = await asyncio.gather(*(client.send(s, self.t0) for s in specs))
            fault.detail = dict(collections.Counter("ok" if r.ok else str(r.error) for r in res))
        elif fault.kind == "kill":
            victim = sorted(n for n in pids if n.startswith("decode"))[-1]
            os.killpg(pids[victim], signal.SIGKILL)  # up starts each child in a session (and group) of its own
            fault.detail = {"victim": victim, "pid": pids[victim]}
        else:
            victim = sorted(n for n in pids if n.startswith("prefill"))[0]
            os.killpg(pids[victim], signal.SIGSTOP)
            try:
                await asyncio.sleep(self.args.stall_s)
            finally:
                os.killpg(pids[victim], signal.SIGCONT)
            fault.detail = {"victim": victim, "stall_s": self.args.stall_s}
        fault.ended = self.now()

    def service_back_s(self, fault: Fault) -> float | None:
        """Seconds from the fault's end until the first probe started after it succeeded (None: none did). This
        includes that probe's own latency, which a saturating load makes long fault or not: compare it with the
        median probe latency before the faults (``probes`` in the report)."""
        ends = [end for start, end, ok in self.probes if ok and start >= fault.ended]
        return round(min(ends) - fault.ended, 2) if ends else None

    def probe_latency_s(self, since: float, until: float) -> float | None:
        xs = [end - start for start, end, ok in self.probes if ok and since <= start < until]
        return round(statistics.median(xs), 2) if xs else None


def private_rss(proc: psutil.Process) -> int:
    """RSS less the shared-memory pages (``RssShmem``): with the ``shm`` KV backend a prefill rank maps each decode
    rank's pool, and every page its transfers touch counts in its RSS until the peer goes (a 300 s soak: +17 MiB/s,
    then -1.9 GB when the stall dropped both peers); a leak is private memory."""
    rss = proc.memory_info().rss
    try:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("RssShmem:"):
                return rss - int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss
