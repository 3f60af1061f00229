"""How often a request's tokens leave the scheduler: a streaming request every ``--stream-interval`` tokens (its
first at once), a non-streaming one (``Engine.generate``) once, with its end; the tokens are the same either way."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import pytest

from common.engine.io_struct import TokenOut
from common.node.engine import Engine
from tests.model_fixtures import make_tiny_model

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 20]
PARAMS = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llama() -> Path:
    return make_tiny_model("llama")


@pytest.fixture
def messages(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Token count of every ``TokenOut`` each request got, in order."""
    seen: dict[str, list[int]] = defaultdict(list)
    apply = Engine._apply

    def spy(self: Engine, state: object, msg: TokenOut) -> str:
        seen[msg.rid].append(len(msg.token_ids))
        return apply(self, state, msg)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "_apply", spy)
    return seen


def _stream(engine: Engine, prompt: list[int]) -> list[int]:
    async def run() -> list[int]:
        ids: list[int] = []
        async for chunk in engine.generate_stream(input_ids=prompt, sampling_params=PARAMS):
            ids += chunk.token_ids
        return ids

    return asyncio.run(run())


def test_stream_interval_batches_tokens_and_keeps_them(llama: Path, messages: dict[str, list[int]]) -> None:
    engine = Engine(model_path=str(llama), stream_interval=5)
    try:
        whole = [o.output_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
        assert [messages[rid] for rid in list(messages)] == [[12]] * 3  # non-streaming: one message each
        messages.clear()
        streamed = [_stream(engine, p) for p in PROMPTS]
        assert streamed == whole
        # the first token at once, then every 5, the rest with the end
        assert list(messages.values()) == [[1, 5, 5, 1]] * 3
        sched = engine.scheduler
        sched.tree_cache.evict(sched.allocator.size)
        assert sched.allocator.available_size() == sched.allocator.size
    finally:
        engine.shutdown()


def test_interval_one_streams_every_token(llama: Path, messages: dict[str, list[int]]) -> None:
    engine = Engine(model_path=str(llama))
    try:
        _stream(engine, PROMPTS[0])
        assert list(messages.values()) == [[1] * 12]
    finally:
        engine.shutdown()


def test_stream_interval_must_be_positive() -> None:
    from common.config import ServerArgs
    from common.errors import ConfigError

    with pytest.raises(ConfigError, match="stream-interval"):
        ServerArgs(stream_interval=0)
