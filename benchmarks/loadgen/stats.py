"""Per-request results and their statistics. Times are seconds on the client's ``time.perf_counter`` clock.

- TTFT: send to the first output chunk; e2e: send to the last byte; ITL: the gaps between consecutive token
  arrivals (a chunk that carries k tokens counts as k tokens spread evenly over its gap; over OpenAI SSE one
  chunk is one sample); TPOT: (e2e - TTFT) / (output tokens - 1), per request.
- Goodput: successful requests per second whose TTFT <= ``Slo.ttft_s`` and whose ITL at ``Slo.itl_quantile``
  (1.0: every gap) <= ``Slo.itl_s``; an unset SLO always holds.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestResult:
    index: int
    kind: str
    start: float  # seconds since the run began
    ok: bool = False
    error: str | None = None  # the error kind, e.g. "http_503", "grpc_UNAVAILABLE", "timeout"
    ttft: float | None = None
    e2e: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each output token, since the run began
    prompt_tokens: int = 0
    output_tokens: int = 0
    server_timing: dict[str, Any] | None = None  # the router's timing breakdown, when it sent one

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def spread_chunk(token_times: list[float], now: float, n_tokens: int) -> None:
    """Record ``n_tokens`` that arrived together at ``now``: spread evenly over the gap since the last token."""
    if n_tokens <= 0:
        return
    if not token_times:
        token_times.append(now)  # the first chunk marks TTFT; tokens inside it have no measurable gaps
        return
    last = token_times[-1]
    step = (now - last) / n_tokens
    token_times.extend(last + step * (i + 1) for i in range(n_tokens))


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); ``q`` in [0, 100]."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe(xs: list[float]) -> dict[str, float | int]:
    """mean/p50/p90/p99/max in milliseconds, and the sample count."""
    if not xs:
        return {"n": 0}
    ms = [x * 1000 for x in xs]
    return {
        "n": len(ms),
        "mean_ms": round(sum(ms) / len(ms), 3),
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
    }


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None = None
    itl_s: float | None = None
    itl_quantile: float = 1.0  # which of a request's ITL gaps must be within ``itl_s`` (1.0: the largest)

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_s is not None and (r.ttft is None or r.ttft > self.ttft_s):
            return False
        gaps = r.itls
        return self.itl_s is None or not gaps or percentile(gaps, self.itl_quantile * 100) <= self.itl_s


def summarize(results: list[RequestResult], wall_s: float, slo: Slo | None = None) -> dict[str, Any]:
    slo = slo or Slo()
    ok = [r for r in results if r.ok]
    wall = max(wall_s, 1e-9)
    good = sum(slo.met(r) for r in results)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error or "unknown" for r in results if not r.ok)),
        "wall_s": round(wall_s, 3),
        "request_throughput": round(len(ok) / wall, 3),
        "output_token_throughput": round(out_tokens / wall, 3),
        "total_token_throughput": round((in_tokens + out_tokens) / wall, 3),
        "goodput": round(good / wall, 3),
        "good_requests": good,
        "slo": {"ttft_ms": _ms(slo.ttft_s), "itl_ms": _ms(slo.itl_s), "itl_quantile": slo.itl_quantile},
        "ttft": describe([r.ttft for r in ok if r.ttft is not None]),
        "itl": describe([g for r in ok for g in r.itls]),
        "tpot": describe([t for r in ok if (t := r.tpot) is not None]),
        "e2e": describe([r.e2e for r in ok if r.e2e is not None]),
        "by_kind": {
            k: {
                "completed": len(rs),
                "ttft": describe([r.ttft for r in rs if r.ttft is not None]),
                "itl": describe([g for r in rs for g in r.itls]),
            }
            for k in sorted({r.kind for r in ok})
            if (rs := [r for r in ok if r.kind == k])
        },
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000
