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


class _Replay:
    def __init__(self, run: Callable[[], object]) -> None:
        self.replay = run


def _eager_capture(cls: type) -> type:
    """``cls`` whose CUDA-graph mode runs without CUDA: each bucket's "graph" re-runs the function it would capture
    on its static arguments and copies the result into the first run's outputs (what a replay does)."""

    class EagerCapture(cls):  # type: ignore[misc, valid-type]
        def _capture(self, bs: int) -> None:
            fn, args = self._capture_inputs(bs)
            first = fn(*args)
            outs = tuple(t.clone() for t in first) if isinstance(first, tuple) else first.clone()

            def replay() -> None:
                got = fn(*args)
                for dst, src in zip(outs if isinstance(outs, tuple) else (outs,),
                                    got if isinstance(got, tuple) else (got,), strict=True):
                    dst.copy_(src)

            self._graph_out[bs] = outs
            self._graphs[bs] = _Replay(replay)

    return EagerCapture


def graph_runner_case(arch: str) -> float:
    """CUDA-graph mode of ``DecodeGraphRunner`` without CUDA: each bucket's "graph" re-runs the function it would
    capture on the static batch (fixed split count, padding rows on the padding row/slot), and the start-up check
    must find every bucket within 1e-5 (of the logits' scale) of eager Triton decode; the check's pages and rows are left clean."""
    from common.config import ServerArgs
    from common.engine import graph_runner
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from tests.model_fixtures import load_tiny_model

    graph_runner.VERIFY_RTOL[torch.float32] = 1e-5
    model = load_tiny_model(arch)
    model.use_triton_kernels()  # as the CUDA runner has it
    cfg = model.config
    pool = MHATokenToKVPool(32, 16, torch.float32, model.num_local_kv_heads, cfg.head_dim, cfg.num_layers)
    r2t = ReqToTokenPool(5, cfg.context_len)
    args = ServerArgs(attention_backend="triton", cuda_graph_max_bs=4, max_running_requests=4)
    runner = _eager_capture(graph_runner.DecodeGraphRunner)(args, model, pool, r2t, model.make_attn_backend("triton"),
                                                            True, 0)
    with torch.inference_mode():
        runner.warm_up()  # raises when a bucket is off
    assert runner.buckets == [1, 2, 4], runner.buckets
    assert all(not buf[16:].any() for buf in pool.k_buffer + pool.v_buffer), "the check left K/V on pages >= 1"
    assert not r2t.req_to_token.any()
    model.use_triton_kernels(False)
    return 0.0


def spec_graph_runners_case() -> float:
    """The CUDA-graph mode of speculation's runners without CUDA (``_eager_capture``), each bucket's start-up check
    within 1e-5 of eager Triton: ``VerifyGraphRunner`` (static tree masks through the extend kernel's mask form,
    trees of 1 .. N rows, a padding request in bucket 2, EAGLE3's captured streams) and ``DraftGraphRunner`` (an
    EAGLE3 head's draft steps over the static branch table) and ``EagleExtendGraphRunner`` (the head's decode-time
    extends: causal chains of 1 .. N rows, a padding request); the checks' pages and rows are left clean."""
    from common.config import ServerArgs
    from common.engine import graph_runner
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from common.engine.spec.draft_extend_graph_runner import EagleExtendGraphRunner
    from common.engine.spec.eagle_graph_runner import DraftGraphRunner
    from common.engine.spec.eagle_loader import load_eagle_head
    from common.engine.spec.eagle_worker import EagleWorker
    from common.engine.verify_graph_runner import VerifyGraphRunner
    from tests.engine.test_eagle_head import head_dir
    from tests.model_fixtures import load_tiny_model

    graph_runner.VERIFY_RTOL[torch.float32] = 1e-5
    model = load_tiny_model("llama")
    model.use_triton_kernels()
    cfg = model.config
    head = load_eagle_head(head_dir("EAGLE3"), "EAGLE3", model, torch.float32, torch.device("cpu"))
    pool = MHATokenToKVPool(32, 4, torch.float32, model.num_local_kv_heads, cfg.head_dim, cfg.num_layers)
    r2t = ReqToTokenPool(3, cfg.context_len)
    args = ServerArgs(attention_backend="triton", cuda_graph_max_bs=2, max_running_requests=2)
    backend = model.make_attn_backend("triton")
    verify = _eager_capture(VerifyGraphRunner)(args, model, pool, r2t, backend, True, 0, 4, head.config.capture)
    worker = EagleWorker(head, pool.num_pages, 4, 2, 2, 3, 4, "triton")
    draft = _eager_capture(DraftGraphRunner)(args, head, worker.kv_pool, worker.attn_backend, 2, 2,
                                             r2t.req_to_token.shape[1] + 3, True, 0)
    # bucket 4: 3 requests, so a request of fewer than N rows sits before another (its rows at i * N, not packed)
    extend_args = args.replace(cuda_graph_max_bs=4, max_running_requests=4)
    extend_r2t = ReqToTokenPool(5, cfg.context_len)
    extend = _eager_capture(EagleExtendGraphRunner)(extend_args, head, worker.kv_pool, extend_r2t, worker.attn_backend,
                                                    True, 0, 3)
    with torch.inference_mode():
        verify.warm_up()  # raises when a bucket is off
        draft.warm_up()
        extend.warm_up()
    assert verify.buckets == [1, 2] and draft.buckets == [1, 2] and extend.buckets == [1, 2, 4]
    assert all(not buf[4:].any() for buf in pool.k_buffer + pool.v_buffer), "the check left K/V on pages >= 1"
    assert all(not buf.any() for buf in worker.kv_pool.k_buffer + worker.kv_pool.v_buffer)
    assert not r2t.req_to_token.any() and not extend_r2t.req_to_token.any()
    model.use_triton_kernels(False)
    return 0.0
