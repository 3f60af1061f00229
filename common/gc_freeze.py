"""Keep the garbage collector off the start-up heap of a long-running process, and off in-flight requests.

A process that imported torch, transformers and grpc holds a few hundred thousand long-lived objects, and a
generation-2 collection traverses all of them. Such a collection fires once enough new objects survived, at whatever
the process is doing then: in the router it held the event loop long enough to be router_overhead's p99; in a rank
it would stall a step (there it is insurance). Figures: benchmarks/pages/router_overhead.md.
``freeze_startup_heap`` moves everything alive at the end of start-up to the permanent generation (the collector
never scans it again; reference counting still frees those objects), so later collections only traverse what
serving allocated.

An event-loop server (the router, a node's front) also raises the young generation's threshold
(``SERVING_YOUNG_THRESHOLD``): every in-flight request holds a few dozen tracked objects (coroutines, async
generators, futures, frames) for its whole life, and with CPython's default (a collection every 700 net allocations)
each collection traversed the same ~2,000 in-flight objects again and promoted them to be traversed once more in
generation 1. At 20,000 the router spends a fraction of the collection time per request at a similar longest pause
(benchmarks/pages/sglang_router_compare.md).
"""

from __future__ import annotations

import gc

SERVING_YOUNG_THRESHOLD = 20_000


def freeze_startup_heap(young_threshold: int | None = None) -> None:
    """Call once, when start-up is done: collect start-up's garbage, then freeze what is left. ``young_threshold``:
    the young generation's collection threshold from now on (None: leave the process's own)."""
    gc.collect()
    gc.freeze()
    if young_threshold is not None:
        _, g1, g2 = gc.get_threshold()
        gc.set_threshold(young_threshold, g1, g2)
