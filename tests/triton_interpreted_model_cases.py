"""Whole-model Triton cases for ``tests.triton_interpreted_cases`` (run under ``TRITON_INTERPRET=1`` in its
subprocess): a tiny model, an engine and the graph runner on the Triton backend against the torch backend."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.triton_interpreted_cases import _check


def model_case(arch: str, page_size: int, first_len: int = 26) -> float:
    """Tiny model, triton backend vs torch backend: prefill, a shared-prefix extend, then 2 decode steps."""
    from common.engine.model.triton_backend import TritonAttentionBackend
    from tests.model_fixtures import PagedHarness, load_tiny_model

    model = load_tiny_model(arch)
    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(n)] for i, n in enumerate((first_len, 11))]
    worst = 0.0
    runs = []
    for backend in ("torch", "triton"):
        h = PagedHarness(model, page_size, num_pages=1024 // page_size, max_reqs=4)
        h.backend = model.make_attn_backend(backend)
        model.use_triton_kernels(backend == "triton")
        assert isinstance(h.backend, TritonAttentionBackend) == (backend == "triton")
        h.add("a")
        h.add("b")
        steps = [h.forward([("a", prompts[0]), ("b", prompts[1])])]
        h.add("c", share_prefix_of="a", prefix_len=16)
        steps.append(h.forward([("c", [*prompts[0][16:], 9, 8, 7])]))  # prefix hit: extend after 16 cached tokens
        for t in range(2):
            steps.append(h.forward([("a", [11 + t]), ("b", [12 + t]), ("c", [13 + t])]))
        runs.append(steps)
    model.use_triton_kernels(False)
    for torch_step, triton_step in zip(*runs, strict=True):
        for a, b in zip(torch_step, triton_step, strict=True):
            worst = max(worst, _check(b, a, 1e-4))
    return worst


def engine_case() -> float:
    """The engine with ``attention_backend="triton"`` (interpreted) generates what the torch backend generates.
    The second request arrives once the first is decoding, so (with --enable-mixed-chunk, chunk 32) its prefill
    chunks run in mixed batches beside that decode; its second chunk continues a cached prefix."""
    import asyncio

    from common.node.engine import Engine
    from tests.conftest import assert_pools_released
    from tests.model_fixtures import make_tiny_model

    prompts = [[(5 * i + j) % 900 + 3 for j in range(n)] for i, n in enumerate((21, 40))]
    max_new = (6, 3)

    async def run(engine: Engine) -> list[list[int]]:
        async def one(i: int, started: asyncio.Event | None) -> list[int]:
            ids: list[int] = []
            params = {"max_new_tokens": max_new[i], "temperature": 0.0, "ignore_eos": True}
            async for chunk in engine.generate_stream(input_ids=prompts[i], sampling_params=params):
                ids.extend(chunk.token_ids)
                if started is not None:
                    started.set()
            return ids

        started = asyncio.Event()
        first = asyncio.create_task(one(0, started))
        await asyncio.wait_for(started.wait(), timeout=60)
        second = await one(1, None)
        return [await first, second]

    outs = {}
    for backend in ("torch", "triton"):
        engine = Engine(model_path=str(make_tiny_model("llama")), attention_backend=backend, page_size=16,
                        max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=32,
                        enable_mixed_chunk=True)
        try:
            backend_obj = engine.scheduler.runner.attn_backend
            assert type(backend_obj).__name__ == ("TritonAttentionBackend" if backend == "triton" else
                                                  "TorchAttentionBackend")
            init = backend_obj.init_forward_metadata
            seen: list[list[int]] = []
            backend_obj.init_forward_metadata = lambda fb, init=init, seen=seen: (
                seen.append(list(fb.extend_lens_cpu)), init(fb))[1]
            outs[backend] = asyncio.run(run(engine))
            if backend == "triton":  # interpreted steps are slow: the first request is surely still decoding
                assert any(1 in ext and max(ext) > 1 for ext in seen), f"no mixed batch among {seen}"
            assert_pools_released(engine)
        finally:
            engine.shutdown()
    assert outs["triton"] == outs["torch"], f"triton {outs['triton']} != torch {outs['torch']}"
    return 0.0


def graph_runner_case(arch: str) -> float:
    """CUDA-graph mode of ``DecodeGraphRunner`` without CUDA: each bucket's "graph" re-runs the function it would
    capture on the static batch (fixed split count, padding rows on the padding row/slot), and the start-up check
    must find every bucket within 1e-5 (of the logits' scale) of eager Triton decode; the check's pages and rows are left clean."""
    from common.config import ServerArgs
    from common.engine import graph_runner
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from tests.model_fixtures import load_tiny_model

    class Replay:
        def __init__(self, run: Callable[[], object]) -> None:
            self.replay = run

    class EagerCapture(graph_runner.DecodeGraphRunner):
        def _capture(self, bs: int) -> None:
            fn, fb = self._capture_inputs(bs)
            out = fn(self.model, fb).clone()
            self._graph_out[bs] = out
            self._graphs[bs] = Replay(lambda: out.copy_(fn(self.model, fb)))  # type: ignore[assignment]

    graph_runner.VERIFY_RTOL[torch.float32] = 1e-5
    model = load_tiny_model(arch)
    model.use_triton_kernels()  # as the CUDA runner has it
    cfg = model.config
    pool = MHATokenToKVPool(32, 16, torch.float32, model.num_local_kv_heads, cfg.head_dim, cfg.num_layers)
    r2t = ReqToTokenPool(5, cfg.context_len)
    args = ServerArgs(attention_backend="triton", cuda_graph_max_bs=4, max_running_requests=4)
    runner = EagerCapture(args, model, pool, r2t, model.make_attn_backend("triton"), True, 0)
    with torch.inference_mode():
        runner.warm_up()  # raises when a bucket is off
    assert runner.buckets == [1, 2, 4], runner.buckets
    assert all(not buf[16:].any() for buf in pool.k_buffer + pool.v_buffer), "the check left K/V on pages >= 1"
    assert not r2t.req_to_token.any()
    model.use_triton_kernels(False)
    return 0.0
