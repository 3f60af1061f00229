"""Compiled decode steps on CPU (``common.engine.graph_runner``): buckets, flags, the compile-friendly decode attention
against the eager backend, the start-up check's fallback, and ``--enable-torch-compile`` through the engine
(logits of every compiled step within 1e-4 of eager, greedy identity). CUDA graphs: tests/gpu/test_graph_runner_cuda.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import ServerArgs, add_server_args, server_args_from_cli
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.graph_runner import DecodeGraphRunner, batch_size_buckets, build_graph_runner
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.mem.req_to_token_pool import ReqToTokenPool
from common.engine.model.attention import TorchAttentionBackend
from common.engine.model.layers import Linear
from common.engine.model.padded_decode_backend import (
    PaddedDecodeBackend,
    PaddedDecodeMetadata,
    padded_page_table,
)
from common.errors import ConfigError
from tests.model_fixtures import load_tiny_model

ATOL = 1e-4


def test_batch_size_buckets() -> None:
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(3) == [1, 2, 3]
    assert batch_size_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    big = batch_size_buckets(300)
    assert big[-4:] == [256, 272, 288, 300] and big == sorted(set(big))


def test_flags_parse_and_bad_values_are_refused() -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = server_args_from_cli(parser.parse_args(
        ["--enable-torch-compile", "--torch-compile-max-bs", "4", "--cuda-graph-max-bs", "64", "--disable-cuda-graph"]
    ))
    assert (args.enable_torch_compile, args.torch_compile_max_bs, args.cuda_graph_max_bs) == (True, 4, 64)
    assert args.disable_cuda_graph and not args.use_cuda_graph
    assert ServerArgs(device="cuda").use_cuda_graph and not ServerArgs().use_cuda_graph
    assert ServerArgs(max_running_requests=8).resolved_cuda_graph_max_bs == 8
    with pytest.raises(ConfigError, match="--torch-compile-max-bs"):
        ServerArgs(torch_compile_max_bs=0)
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs"):
        ServerArgs(cuda_graph_max_bs=-1)
    with pytest.raises(ConfigError, match="--tp-size 1"):
        ServerArgs(enable_torch_compile=True, tp_size=2)


@pytest.mark.parametrize(("page_size", "window"), [(16, None), (4, 7), (1, None)])
def test_padded_decode_attention_matches_the_eager_backend(page_size: int, window: int | None) -> None:
    """Requests on scattered pages plus padding rows (padding_row, seq_len 1, slot 0): the real rows equal the
    eager backend's output, and the padded rows touch only the padding page."""
    heads, kv_heads, d, num_pages = 4, 2, 8, 64
    rng = random.Random(page_size)
    gen = torch.Generator().manual_seed(page_size)
    pool = MHATokenToKVPool(num_pages, page_size, torch.float32, kv_heads, d, 1)
    pool.k_buffer[0][page_size:] = torch.randn(num_pages * page_size, kv_heads, d, generator=gen)
    pool.v_buffer[0][page_size:] = torch.randn(num_pages * page_size, kv_heads, d, generator=gen)
    r2t = ReqToTokenPool(4, 64)
    free = list(range(1, num_pages + 1))
    rng.shuffle(free)
    lens = [1, 9, 33, 20]
    for row, n in enumerate(lens):
        pages = [free.pop() for _ in range(-(-n // page_size))]
        r2t.write(row, 0, [pages[p // page_size] * page_size + p % page_size for p in range(n)])
    n, bs = len(lens), len(lens) + 2
    seq = torch.tensor([*lens, 1, 1])
    rpi = torch.tensor([0, 1, 2, 3] + [r2t.padding_row] * 2)
    loc = torch.cat([r2t.req_to_token[rpi[:n], seq[:n] - 1], torch.zeros(2, dtype=torch.int64)])
    q = torch.randn(bs, heads, d, generator=gen)
    k = torch.randn(bs, kv_heads, d, generator=gen)
    v = torch.randn(bs, kv_heads, d, generator=gen)

    def batch(rows: int, backend: Any) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=rows, input_ids=torch.zeros(rows, dtype=torch.int64),
            positions=seq[:rows] - 1, out_cache_loc=loc[:rows], req_pool_indices=rpi[:rows], seq_lens=seq[:rows],
            extend_lens=torch.ones(rows, dtype=torch.int64), prefix_lens=seq[:rows] - 1,
            req_to_token=r2t.req_to_token, seq_lens_cpu=seq[:rows].tolist(), extend_lens_cpu=[1] * rows,
            prefix_lens_cpu=(seq[:rows] - 1).tolist(), kv_pool=pool, attn_backend=backend,
        )

    eager = TorchAttentionBackend(heads, kv_heads, d, window)
    fb = batch(n, eager)
    eager.init_forward_metadata(fb)
    want = eager.forward(q[:n], k[:n], v[:n], 0, fb)
    before = [buf.clone() for buf in (pool.k_buffer[0], pool.v_buffer[0])]
    padded = PaddedDecodeBackend(heads, kv_heads, d, page_size, window)
    pfb = batch(bs, padded)
    table = padded_page_table(r2t.req_to_token, rpi, -(-max(lens) // page_size) + 1, page_size)
    pfb.attn_metadata = PaddedDecodeMetadata(table, seq)
    got = padded.forward(q, k, v, 0, pfb)
    assert torch.allclose(got[:n], want, atol=ATOL, rtol=0)
    for buf, old in zip((pool.k_buffer[0], pool.v_buffer[0]), before, strict=True):
        changed = (buf != old).flatten(1).any(1).nonzero().flatten().tolist()
        assert all(slot < page_size for slot in changed), changed  # only the padding page was written
    assert not r2t.req_to_token[r2t.padding_row].any()


def test_a_runner_that_fails_its_check_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A compiled step that computes the wrong thing is caught at start-up: a warning names the reason and decode
    runs eagerly (no compile happens: the compiled call is replaced by a wrong one)."""
    model = load_tiny_model("llama")
    args = ServerArgs(enable_torch_compile=True, torch_compile_max_bs=2, max_running_requests=4)
    cfg = model.config
    pool = MHATokenToKVPool(16, 16, torch.float32, model.num_local_kv_heads, cfg.head_dim, cfg.num_layers)
    r2t = ReqToTokenPool(5, cfg.context_len)

    def wrong(self: DecodeGraphRunner, bs: int, max_seq_len: int) -> torch.Tensor:
        return torch.zeros(bs, cfg.hidden_size)

    monkeypatch.setattr(DecodeGraphRunner, "_run_compiled", wrong)
    with caplog.at_level(logging.WARNING, logger="common.engine.graph_runner"):
        assert build_graph_runner(args, model, pool, r2t, model.make_attn_backend()) is None
    assert "logits differ from eager" in caplog.text and "run eagerly" in caplog.text
    prefill = args.replace(disaggregation_mode="prefill", disaggregation_bootstrap_port=8998)
    assert build_graph_runner(prefill, model, pool, r2t, model.make_attn_backend()) is None  # never decodes
    assert all(not buf.any() for buf in pool.k_buffer + pool.v_buffer)  # the check's dummy KV is wiped
    assert not r2t.req_to_token.any()


def set_elsewhere(num_threads: int) -> None:
    """The process's torch thread count for threads started from now on; this thread's own count is kept."""
    thread = threading.Thread(target=torch.set_num_threads, args=(num_threads,))
    thread.start()
    thread.join()


def test_torch_compile_matches_eager_through_the_engine(engine_factory: Any, model_path: Path) -> None:
    """--enable-torch-compile (buckets 1, 2): every compiled decode step's logits within 1e-4 of the eager forward
    of the same batch, greedy outputs identical to an eager engine's, and no compile after start-up. Batches of 3
    run eagerly; requests finishing at different lengths take the batch through 3 -> 2 -> 1 (bucket 2 padded)."""
    prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(n)] for i, n in enumerate((5, 37, 70))]
    lengths = (12, 20, 28)

    def generate(engine: Any) -> list[list[int]]:
        async def one(prompt: list[int], n: int) -> list[int]:
            ids: list[int] = []
            params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
            async for chunk in engine.generate_stream(input_ids=prompt, sampling_params=params):
                ids.extend(chunk.token_ids)
            return ids

        async def run() -> list[list[int]]:
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths, strict=True)))

        return asyncio.run(run())

    common = {"max_running_requests": 4, "max_total_tokens": 2048}
    # torch's thread count is per thread, and new threads take the process's last set_num_threads: set it from
    # another thread (as an earlier test's engine may have) so that a scheduler thread left to inherit it would
    # serve with a count other than the one its steps were compiled under (dynamo guards on it: a recompile).
    here = torch.get_num_threads()
    set_elsewhere(2 if here == 1 else 1)
    # Another test file of this worker process may have compiled the same model code: its frames' recorded shapes
    # would make dynamo recompile here (automatic dynamic shapes). A node compiles in a process of its own.
    torch._dynamo.reset()
    start = time.monotonic()
    compiled = engine_factory(model_path, enable_torch_compile=True, torch_compile_max_bs=2, **common)
    startup = time.monotonic() - start
    runner = compiled.scheduler.runner
    graphs = runner.graph_runner
    assert graphs is not None and graphs.buckets == [1, 2], "the compiled runner failed its start-up check"
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    steps: list[tuple[int, float]] = []
    compiled_forward = graphs.forward_features

    def checked(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = compiled_forward(fb)[0].clone()
        runner.attn_backend.init_forward_metadata(fb)
        eager = runner.model.forward(fb)  # rewrites the same K/V slots with eager's values
        err = float((runner.model.compute_logits(hidden) - runner.model.compute_logits(eager)).abs().max())
        steps.append((fb.batch_size, err))
        return hidden, hidden

    graphs.forward_features = checked
    try:
        outs = generate(compiled)
    finally:
        set_elsewhere(here)
    assert {bs for bs, _ in steps} == {1, 2}, steps
    assert max(err for _, err in steps) <= ATOL, steps
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles, "recompiled while serving"

    eager = engine_factory(model_path, **common)
    assert eager.scheduler.runner.graph_runner is None
    # Eager CPU steps multiply through oneDNN-packed weights; compiled ones trace the plain weights (F.linear).
    packed = [m.packed for m in eager.scheduler.runner.model.modules() if isinstance(m, Linear)]
    assert packed and all(packed) == torch.backends.mkldnn.is_available()
    assert not any(m.packed for m in runner.model.modules() if isinstance(m, Linear))
    assert outs == generate(eager)
    assert [len(o) for o in outs] == list(lengths)
    print(f"compiled engine start-up {startup:.1f} s; {len(steps)} compiled steps, max |dlogits| "
          f"{max(err for _, err in steps):.2e}")
