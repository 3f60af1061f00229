"""Decode steps replayed as CUDA graphs (``common.engine.graph_runner``) against eager decode on the same GPU.

- bf16: every replayed step's logits against the eager forward of the same batch, within 4 bf16 ulps of the step's
  largest logit (at least BF16_ATOL): the graph fixes the Triton kernel's split count by occupancy, eager picks it
  by length, so the sums are ordered differently and the bf16 roundings of 16+ layers drift apart by a few ulps.
- fp32: greedy outputs identical to an engine with --disable-cuda-graph, on prompts whose batches shrink as
  requests finish (so padded buckets replay), and each replayed step's logits within 1e-4 of eager.
- --enable-torch-compile with graphs: the compiled forward is what is captured, same fp32 checks.
Skipped without CUDA (tests/gpu/conftest.py).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch

from common.engine.forward_batch import ForwardBatch
from tests.gpu.test_engine_cuda import prompts, small_model

ATOL = 1e-4
BF16_ATOL = 0.25  # floor of the bf16 tolerance: 4 bf16 ulps of the largest logit of the step, at least this
BF16_ULPS = 4


def bf16_tolerance(max_logit: float) -> float:
    """4 ulps of bf16 (8 significant bits) at the step's largest |logit|, not below BF16_ATOL."""
    return max(BF16_ATOL, BF16_ULPS * 2.0 ** (math.floor(math.log2(max(max_logit, 1e-6))) - 7))


def _record_against_eager(engine: Any, scales: list[float] | None = None) -> list[tuple[int, float]]:
    """Wraps the engine's graph runner: each replayed step also runs eagerly; returns (batch size, max |dlogits|)
    per step as the engine serves (and appends each step's max |logit| of eager to ``scales``)."""
    runner = engine.scheduler.runner
    graphs = runner.graph_runner
    assert graphs is not None and graphs.use_cuda_graph, "CUDA graphs failed their start-up check (see the log)"
    steps: list[tuple[int, float]] = []
    replay = graphs.forward_features

    def checked(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = replay(fb)[0].clone()
        runner.attn_backend.init_forward_metadata(fb)
        eager = runner.model.forward(fb)
        reference = runner.model.compute_logits(eager)
        diff = runner.model.compute_logits(hidden) - reference
        steps.append((fb.batch_size, float(diff.abs().max())))
        if scales is not None:
            scales.append(float(reference.abs().max()))
        return hidden, hidden

    graphs.forward_features = checked
    return steps


def _generate(engine: Any, batch: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Concurrent greedy requests of different output lengths: the decode batch shrinks as they finish."""

    async def one(prompt: list[int], n: int) -> list[int]:
        ids: list[int] = []
        params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
        async for chunk in engine.generate_stream(input_ids=prompt, sampling_params=params):
            ids.extend(chunk.token_ids)
        return ids

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(one(p, n) for p, n in zip(batch, lengths, strict=True)))

    return asyncio.run(run())


def test_bf16_replayed_logits_within_tolerance_of_eager(engine_factory) -> None:
    engine = engine_factory(small_model(), device="cuda", dtype="bfloat16", cuda_graph_max_bs=16)
    scales: list[float] = []
    steps = _record_against_eager(engine, scales)
    batch = prompts(12, 8000, seed=4)
    _generate(engine, batch, [8 + 3 * i for i in range(12)])
    assert len({bs for bs, _ in steps}) >= 3, steps
    off = [(bs, err, scale) for (bs, err), scale in zip(steps, scales, strict=True) if err > bf16_tolerance(scale)]
    assert not off, f"(batch, max |dlogit|, max |logit|) beyond {BF16_ULPS} bf16 ulps: {off[:8]}"


def test_fp32_greedy_identity_with_padded_buckets(engine_factory) -> None:
    path = small_model()
    batch = prompts(10, 8000, seed=5)
    lengths = [6 + 4 * i for i in range(10)]
    graphs = engine_factory(path, device="cuda", cuda_graph_max_bs=16)
    assert graphs.scheduler.runner.graph_runner.buckets == [1, 2, 4, 8, 16]
    steps = _record_against_eager(graphs)
    outs = _generate(graphs, batch, lengths)
    eager = engine_factory(path, device="cuda", disable_cuda_graph=True)
    assert eager.scheduler.runner.graph_runner is None
    assert outs == _generate(eager, batch, lengths)
    assert {bs for bs, _ in steps} >= {1, 3, 5}, steps  # 3 and 5 replay the padded buckets 4 and 8
    assert max(err for _, err in steps) <= ATOL, steps


def test_torch_compile_captured_in_graphs(engine_factory) -> None:
    path = small_model()
    batch = prompts(3, 8000, seed=6)
    lengths = [6, 12, 18]
    engine = engine_factory(path, device="cuda", enable_torch_compile=True, torch_compile_max_bs=4,
                            cuda_graph_max_bs=4)
    graphs = engine.scheduler.runner.graph_runner
    assert graphs is not None and graphs.compile_max_bs == 4, "compiled capture failed its start-up check"
    steps = _record_against_eager(engine)
    outs = _generate(engine, batch, lengths)
    eager = engine_factory(path, device="cuda", disable_cuda_graph=True)
    assert outs == _generate(eager, batch, lengths)
    assert max(err for _, err in steps) <= ATOL, steps
