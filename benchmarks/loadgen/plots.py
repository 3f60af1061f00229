"""PNG plots with matplotlib (Agg backend): latency CDFs and ITL over time."""

from __future__ import annotations

import itertools
from pathlib import Path

from benchmarks.loadgen.stats import RequestResult


def _cdf(ax: object, xs: list[float], label: str) -> None:
    s = sorted(x * 1000 for x in xs)
    if s:
        ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=label)  # type: ignore[attr-defined]


def latency_cdfs(series: dict[str, list[RequestResult]], path: Path) -> Path:
    """One panel per metric (TTFT, ITL, e2e), one line per series (e.g. one per configuration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, results in series.items():
        ok = [r for r in results if r.ok]
        _cdf(axes[0], [r.ttft for r in ok if r.ttft is not None], name)
        _cdf(axes[1], [g for r in ok for g in r.itls], name)
        _cdf(axes[2], [r.e2e for r in ok if r.e2e is not None], name)
    for ax, title in zip(axes, ("TTFT", "ITL (per token gap)", "end-to-end latency"), strict=True):
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_xscale("log")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def itl_over_time(series: dict[str, list[RequestResult]], path: Path) -> Path:
    """Each ITL gap at the time its token arrived: stalls (e.g. a long prefill) show as spikes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4))
    for name, results in series.items():
        xs, ys = [], []
        for r in results:
            t = r.token_times
            xs.extend(t[1:])
            ys.extend((b - a) * 1000 for a, b in itertools.pairwise(t))
        ax.scatter(xs, ys, s=2, alpha=0.5, label=name)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("ITL (ms)")
    ax.set_yscale("log")
    ax.set_title("ITL over time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, markerscale=4)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_plots(series: dict[str, list[RequestResult]], prefix: Path) -> list[Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    return [
        latency_cdfs(series, prefix.with_name(prefix.name + "_cdf.png")),
        itl_over_time(series, prefix.with_name(prefix.name + "_itl_time.png")),
    ]
