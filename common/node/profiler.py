"""Torch profiler windows over a scheduler loop, started and stopped from another thread.

The torch profiler records the CPU ops of the thread that starts it (all threads only where asked), so a window over an ``Engine``'s steps must be
opened and closed on its scheduler thread: ``start``/``stop`` post a command that the loop runs at its next
``poll`` and wait, with a deadline, for the loop to answer.
"""

from __future__ import annotations

import queue
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from common.errors import ConfigError


def _all_threads() -> dict[str, Any]:
    """Record every thread's ops (the overlap schedule runs the forward on a thread of its own), where this torch
    has the option."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


class StepProfiler:
    def __init__(self) -> None:
        self._commands: queue.Queue[str] = queue.Queue()
        self._answers: queue.Queue[Any] = queue.Queue()
        self._prof: profile | None = None

    # -- caller's thread ---------------------------------------------------------------------------------------
    def start(self, timeout: float) -> None:
        self._ask("start", timeout)

    def stop(self, timeout: float) -> profile:
        """The finished profile of the steps run since ``start``."""
        return self._ask("stop", timeout)

    def _ask(self, command: str, timeout: float) -> Any:
        self._commands.put(command)
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the scheduler loop did not {command} the profiler within {timeout:.0f} s") from None
        if isinstance(answer, Exception):
            raise answer
        return answer

    # -- scheduler thread --------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Run the pending commands (call once per loop iteration, before the step; no command: one emptiness
        check, no exception raised on the loop's hot path)."""
        while not self._commands.empty():
            self._answers.put(self._run(self._commands.get_nowait()))

    def _run(self, command: str) -> Any:
        if command == "start":
            if self._prof is not None:
                return ConfigError("a profile is already running; stop it first")
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=acts, **_all_threads())
            self._prof.start()
            return True
        if self._prof is None:
            return ConfigError("no profile is running; start one first")
        prof, self._prof = self._prof, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        return prof
