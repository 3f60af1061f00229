"""Does a storm of huge prompts stall the router? Small-request and ``/liveness`` latency, idle vs. during the storm.

Mock workers in this process (router/testing.py ``fleet``, context raised so ~3.9 MB prompts fit); the
storm is ``--big`` concurrent completions of ``--big-bytes`` ASCII bytes each. Run the same script on two checkouts
for a before/after figure; the machine's /proc/loadavg is printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import aiohttp

from router.testing import fleet

WORDS = ("alpha", "beta", "gamma", "delta", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "12345")


def big_prompt(nbytes: int, seed: int) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < nbytes:
        w = rng.choice(WORDS)
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)[:nbytes]


async def timed(session: aiohttp.ClientSession, method: str, url: str, **kw: object) -> float:
    t = time.perf_counter()
    async with session.request(method, url, **kw) as r:  # type: ignore[arg-type]
        body = await r.read()
        assert r.status == 200, (r.status, body[:300])
    return time.perf_counter() - t


async def probe(
    session: aiohttp.ClientSession, base: str, n: int, gap_s: float, until: asyncio.Future[object] | None = None
) -> dict[str, list[float]]:
    """``n`` probes, or with ``until`` as many as fit before it is done."""
    small = {"prompt": "hello there", "max_tokens": 1}
    out: dict[str, list[float]] = {"small": [], "liveness": []}
    while len(out["small"]) < n if until is None else not until.done():
        out["small"].append(await timed(session, "POST", base + "/v1/completions", json=small))
        out["liveness"].append(await timed(session, "GET", base + "/liveness"))
        await asyncio.sleep(gap_s)
    return out


def summary(name: str, xs: list[float]) -> str:
    return f"{name:9s} p50 {statistics.median(xs) * 1e3:8.1f} ms   max {max(xs) * 1e3:8.1f} ms"


async def main(ns: argparse.Namespace) -> None:
    prompts = [big_prompt(ns.big_bytes, i) for i in range(ns.big)]
    timeout = aiohttp.ClientTimeout(total=ns.timeout)
    # rpc_timeout_s: the in-process mocks parse and hash the ~2.4M-id prompts on this loop; health checks must wait
    kw = {"request_timeout_s": ns.timeout, "rpc_timeout_s": 20.0}
    async with fleet(common={"context_len": 1 << 23, "total_kv_pages": 1 << 20}, **kw) as f, aiohttp.ClientSession(
        timeout=timeout
    ) as session:
        base = f.server.http_url
        await probe(session, base, 3, 0.0)  # warm-up
        idle = await probe(session, base, ns.probes, ns.gap)
        t0 = time.perf_counter()
        bigs = asyncio.gather(
            *(timed(session, "POST", base + "/v1/completions", json={"prompt": p, "max_tokens": 1}) for p in prompts)
        )
        storm = await probe(session, base, 0, ns.gap, until=bigs)
        big_s = await bigs
        print(f"storm: {ns.big} prompts of {ns.big_bytes} bytes, all done in {time.perf_counter() - t0:.1f} s "
              f"(each {min(big_s):.1f}-{max(big_s):.1f} s)")
        for name in ("small", "liveness"):
            print("idle  ", summary(name, idle[name]))
            slow = sum(x > statistics.median(idle[name]) + 0.1 for x in storm[name])
            print("storm ", summary(name, storm[name]), f"  ({len(storm[name])} probes, {slow} over idle p50 + 100 ms)")
    print("loadavg", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--big", type=int, default=4)
    ap.add_argument("--big-bytes", type=int, default=3_900_000)
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--gap", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=120.0)
    asyncio.run(main(ap.parse_args()))
