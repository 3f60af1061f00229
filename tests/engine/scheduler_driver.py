"""``Driver``: a real scheduler stepped by hand for the scheduling tests (test_schedule_policy.py,
test_priority_preemption.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput, TokenOut
from common.engine.sampling.params import SamplingParams
from common.engine.scheduler import Scheduler
from common.text.tokenizer import load_tokenizer
from tests.conftest import assert_pools_released

PS = 4


class Driver:
    """A scheduler stepped by hand (no thread): every request of a ``submit`` arrives in the same step."""

    def __init__(self, path: Path, **kw: Any) -> None:
        kw = {"max_total_tokens": 4096, "page_size": PS, "disable_overlap_schedule": True, **kw}
        self.outs: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.done: list[str] = []
        self.errors: dict[str, str] = {}
        self.scheduler = Scheduler(ServerArgs(model_path=str(path), **kw), str(path), load_tokenizer(str(path)),
                                   self.sink)
        self.forward_tokens = 0
        run_batch = self.scheduler.run_batch

        def counting(batch: Any) -> Any:
            if batch.forward_mode.is_extend():
                self.forward_tokens += sum(batch.extend_lens)
            return run_batch(batch)

        self.scheduler.run_batch = counting  # type: ignore[method-assign]

    def sink(self, msgs: list[Any]) -> None:
        for m in msgs:
            if isinstance(m, TokenOut):
                self.outs.setdefault(m.rid, []).extend(m.token_ids)
                if m.finish_reason is not None:
                    self.done.append(m.rid)
                    self.cached[m.rid] = m.cached_tokens
                    if m.error:
                        self.errors[m.rid] = m.error

    def submit(self, reqs: list[tuple[str, list[int]]], priority: int | None = None, **sp: Any) -> None:
        params = msgspec.convert({"temperature": 0.0, "ignore_eos": True, **sp}, SamplingParams)
        msgs = [GenerateReqInput(rid=rid, input_ids=ids, sampling_params=params, priority=priority)
                for rid, ids in reqs]
        self.scheduler.step(msgs)  # type: ignore[arg-type]

    def run(self, until: Any = None, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if (until is not None and until()) or (until is None and self.scheduler.is_idle()):
                return
            self.scheduler.step([])
        raise AssertionError("scheduler did not get there within its step budget")

    def close(self) -> None:
        assert_pools_released(self)
        self.scheduler.close()


class ResolvedReceiver:
    """A decode node's ``KVReceiver`` with its prefill peer resolved: records the pages it would announce."""

    def __init__(self) -> None:
        self.pages: list[int] | None = None

    def send_metadata(self, pages: list[int], metadata_slot: int) -> None:
        self.pages = pages
