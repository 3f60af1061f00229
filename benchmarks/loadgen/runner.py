"""Drive a client with a load shape, bounded in requests and in time.

- closed loop: ``concurrency`` requests in flight; each finished request starts the next.
- open loop: Poisson arrivals at ``rate`` req/s (exponential gaps, seeded), independent of completions.
Once ``time_limit_s`` has passed no new request starts; those in flight get ``grace_s`` more, then are cancelled
and reported as ``cancelled_at_time_limit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass

from benchmarks.loadgen.clients import Client
from benchmarks.loadgen.stats import RequestResult
from benchmarks.loadgen.workload import RequestSpec


@dataclass(frozen=True, slots=True)
class LoadShape:
    concurrency: int | None = 32  # closed loop (ignored when rate is set)
    rate: float | None = None  # open loop, requests per second
    time_limit_s: float = 60.0
    grace_s: float = 30.0
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.rate is None and (self.concurrency is None or self.concurrency < 1):
            raise ValueError("give a concurrency >= 1 (closed loop) or a rate > 0 (open loop)")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")


@dataclass(slots=True)
class RunResult:
    results: list[RequestResult]
    wall_s: float


async def run_load(client: Client, specs: list[RequestSpec], shape: LoadShape) -> RunResult:
    from tqdm import tqdm

    bar = tqdm(total=len(specs), disable=not shape.progress, unit="req", dynamic_ncols=True)
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    deadline = t0 + shape.time_limit_s

    async def one(spec: RequestSpec) -> None:
        try:
            res = await client.send(spec, t0)
        except asyncio.CancelledError:
            res = RequestResult(spec.index, spec.kind, 0.0, error="cancelled_at_time_limit")
            results.append(res)
            bar.update(1)
            raise
        results.append(res)
        bar.update(1)

    tasks: list[asyncio.Task[None]] = []
    if shape.rate is None:
        queue = list(reversed(specs))
        assert shape.concurrency is not None

        async def worker() -> None:
            while queue and time.perf_counter() < deadline:
                await one(queue.pop())

        tasks = [asyncio.create_task(worker()) for _ in range(min(shape.concurrency, len(specs)))]
    else:
        rng = random.Random(shape.seed)
        next_at = t0
        for spec in specs:
            next_at += rng.expovariate(shape.rate)
            if next_at >= deadline:
                break
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(spec)))
    if tasks:
        remaining = max(deadline - time.perf_counter(), 0.0) + shape.grace_s
        _, pending = await asyncio.wait(tasks, timeout=remaining)
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    wall = time.perf_counter() - t0
    bar.close()
    results.sort(key=lambda r: r.index)
    return RunResult(results, wall)
