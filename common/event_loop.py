"""The event loop a server process runs on: uvloop when installed (as vLLM's and SGLang's servers do), else
asyncio's own: less CPU per request in the router (benchmarks/pages/router_overhead.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from common.errors import ConfigError

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop constructor for ``choice`` (None: asyncio's default). "uvloop" without the package is an error."""
    if choice not in EVENT_LOOPS:
        raise ConfigError(f"--event-loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("--event-loop uvloop: the uvloop package is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
