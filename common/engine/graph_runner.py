"""``DecodeGraphRunner``: decode steps replayed as CUDA graphs and/or run through ``torch.compile``.

A decode batch of ``n`` requests runs at the smallest bucket ``bs >= n`` (``batch_size_buckets``). Its inputs are
copied into static buffers of ``max_bs`` rows; rows ``[n, bs)`` are padding::

    row:              | 0 .. n-1: the batch's requests | n .. bs-1: padding       | bs .. max_bs-1: unused |
    input_ids         | the new tokens                 | 0                        |
    positions         | seq_len - 1                    | 0                        |
    out_cache_loc     | the new tokens' KV slots       | 0 (the padding page)     |
    req_pool_indices  | the requests' rows             | padding_row (all slot 0) |
    seq_lens          | lengths after this token       | 1                        |

So a padded row reads and writes only slot 0 of the padding page 0, which no request owns; its output rows are
dropped. Modes, picked once from ``ServerArgs``:

- CUDA graphs (cuda, default unless ``--disable-cuda-graph``; needs the triton attention backend): one graph per
  bucket up to ``--cuda-graph-max-bs``, captured at start-up; the Triton decode kernel reads ``req_to_token`` (fixed
  address) through the static ``req_pool_indices``/``seq_lens``, with the grid's ``num_kv_splits`` fixed per bucket
  (each request's own split count follows its length on the device). With
  ``--enable-torch-compile`` the captured forward is the compiled one (buckets up to ``--torch-compile-max-bs``).
- torch.compile without graphs (any device): the forward compiled per bucket (batch dims static) over
  ``PaddedDecodeBackend``, whose page-table width (pages of the longest request) is the one dynamic dim.

Safety: after each bucket is captured/compiled, a dummy batch (random K/V on free pages, ``n < bs`` rows so padding
is exercised) runs eagerly and through the runner; a failure to capture/compile, non-finite logits or logits
further than ``VERIFY_RTOL`` (of their scale) from eager log a warning with the reason, and decode runs eagerly
instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.config import ServerArgs
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.model.padded_decode_backend import (
    PaddedDecodeBackend,
    PaddedDecodeMetadata,
    padded_page_table,
)

if TYPE_CHECKING:
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from common.engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Largest |logits - eager logits| / max(1, max |eager logits|) the start-up check accepts: a graph that reads a
# wrong row, length or slot is off by O(1) of the logits' scale; one that is right differs by summation order only.
VERIFY_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def batch_size_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond (SGLang's capture sizes), ending at ``max_bs``."""
    sizes = [1, 2, 4, 8, *range(16, 257, 8), *range(272, max_bs + 16, 16)]
    out = [s for s in sizes if s < max_bs]
    return [*out, max_bs]


def _decode_hidden(model: LlamaForCausalLM, fb: ForwardBatch) -> torch.Tensor:
    """What is compiled and captured: the decode forward up to the final norm's hidden states."""
    return model.forward(fb)


class DecodeGraphRunner:
    def __init__(
        self,
        args: ServerArgs,
        model: LlamaForCausalLM,
        kv_pool: MHATokenToKVPool,
        req_to_token_pool: ReqToTokenPool,
        eager_backend: object,
        use_cuda_graph: bool,
        compile_max_bs: int,
    ) -> None:
        """``compile_max_bs``: buckets up to it run the compiled forward (0: nothing compiled). Builds buffers
        only; ``warm_up`` captures/compiles and raises if any bucket fails its check."""
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.eager_backend = eager_backend
        self.use_cuda_graph = use_cuda_graph
        self.device = kv_pool.device
        self.dtype = kv_pool.dtype
        cap = args.resolved_cuda_graph_max_bs if use_cuda_graph else compile_max_bs
        # NOTE: each request of a batch holds a page of its own, so no batch is larger than the pool's pages.
        max_bs = max(1, min(cap, args.max_running_requests, kv_pool.num_pages))
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = max_bs
        self.compile_max_bs = compile_max_bs
        cfg = model.config
        self.padded_backend = PaddedDecodeBackend(
            model.shard.num_heads, model.shard.num_kv_heads, cfg.head_dim, kv_pool.page_size, cfg.sliding_window
        )
        self._compiled: Callable[[LlamaForCausalLM, ForwardBatch], torch.Tensor] | None = None
        if compile_max_bs > 0:
            self._compiled = torch.compile(_decode_hidden)
            limit = len(self.buckets) + 4  # one cache entry per bucket (same code object)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.out_cache_loc = torch.zeros(max_bs, **i64)
        self.req_pool_indices = torch.full((max_bs,), req_to_token_pool.padding_row, **i64)
        self.seq_lens = torch.ones(max_bs, **i64)
        self.extend_lens = torch.ones(max_bs, **i64)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # or anything with replay() (tests on CPU)
        self._graph_out: dict[int, torch.Tensor] = {}
        self._graph_batches: dict[int, ForwardBatch] = {}
        self._graph_pool: object = None

    # -- serving ---------------------------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode == ForwardMode.DECODE and fb.batch_size <= self.max_bs

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode batch (a view of a static buffer under CUDA graphs: read it before
        the next call). Writes the new tokens' K/V like ``model.forward``."""
        n = fb.batch_size
        bs = self._bucket(n)
        self._load(fb, n, bs)
        if self.use_cuda_graph:
            self._graphs[bs].replay()
            return self._graph_out[bs][:n]
        return self._run_compiled(bs, max(fb.seq_lens_cpu))[:n]

    def _bucket(self, n: int) -> int:
        for bs in self.buckets:
            if bs >= n:
                return bs
        raise ValueError(f"decode batch of {n} exceeds the largest bucket {self.max_bs}")

    def _load(self, fb: ForwardBatch, n: int, bs: int) -> None:
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        self.seq_lens[:n].copy_(fb.seq_lens)
        if n < bs:
            self._pad(n, bs)

    def _pad(self, start: int, end: int) -> None:
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.out_cache_loc[start:end].zero_()
        self.req_pool_indices[start:end].fill_(self.req_to_token_pool.padding_row)
        self.seq_lens[start:end].fill_(1)

    def _static_batch(self, bs: int, backend: object, metadata: object) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            prefix_lens=self.positions[:bs],  # decode: prefix_len == seq_len - 1 == position
            req_to_token=self.req_to_token_pool.device_req_to_token,
            seq_lens_cpu=[],  # not read: every operand of the static batch is a tensor
            extend_lens_cpu=[],
            prefix_lens_cpu=[],
            kv_pool=self.kv_pool,
            attn_backend=backend,
            attn_metadata=metadata,
        )

    def _run_compiled(self, bs: int, max_seq_len: int) -> torch.Tensor:
        assert self._compiled is not None
        ps = self.kv_pool.page_size
        # NOTE: at least 2 pages, so the dynamic dim never takes the 0/1 values that dynamo specializes on.
        num_pages = max(2, -(-max_seq_len // ps))
        table = padded_page_table(self.req_to_token_pool.device_req_to_token, self.req_pool_indices[:bs],
                                  num_pages, ps)
        torch._dynamo.mark_dynamic(table, 1)
        fb = self._static_batch(bs, self.padded_backend, PaddedDecodeMetadata(table, self.seq_lens[:bs]))
        # Batch dims stay static per bucket (one graph each); the page-table width is the one dynamic dim.
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            return self._compiled(self.model, fb)

    # -- start-up --------------------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Capture (CUDA graphs) or compile every bucket, then check each against eager on a dummy batch. Raises
        on the first failure; the caller falls back to eager."""
        what = "capturing CUDA graphs" if self.use_cuda_graph else "compiling decode steps"
        if self.compile_max_bs:
            what += f" (torch.compile up to batch {self.compile_max_bs})"
        logger.info("%s for batch sizes %s", what, self.buckets)
        start = time.monotonic()
        for i, bs in enumerate(reversed(self.buckets)):  # largest first: smaller graphs reuse its memory pool
            t0 = time.monotonic()
            if self.use_cuda_graph:
                self._capture(bs)
            self._verify(bs)
            logger.info("decode batch size %d ready (%d/%d, %.1f s)", bs, i + 1, len(self.buckets),
                        time.monotonic() - t0)
        logger.info("%s done in %.1f s", what, time.monotonic() - start)

    def _capture_inputs(self, bs: int) -> tuple[Callable[[LlamaForCausalLM, ForwardBatch], torch.Tensor],
                                                 ForwardBatch]:
        """The function a bucket's graph captures and its static batch (padding rows only, until replayed)."""
        from common.engine.model.triton_backend import TritonAttnMetadata

        backend = self.eager_backend
        # NOTE: a graph fixes the grid (by batch size alone); each request still takes the splits its own length
        # asks for, on the device (common/engine/kernels/decode_attention.py).
        splits = backend.grid_kv_splits(bs)  # type: ignore[attr-defined]
        fb = self._static_batch(bs, backend, TritonAttnMetadata(True, splits, None, 1))
        fn = self._compiled if self._compiled is not None and bs <= self.compile_max_bs else _decode_hidden
        self._pad(0, bs)
        self._graph_batches[bs] = fb
        return fn, fb

    def _capture(self, bs: int) -> None:
        fn, fb = self._capture_inputs(bs)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton JIT, autotuning and compilation happen here, outside the capture
                fn(self.model, fb)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (transfer, gRPC) may touch CUDA while this one captures.
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            out = fn(self.model, fb)
        self._graph_pool = graph.pool()
        self._graphs[bs] = graph
        self._graph_out[bs] = out

    def _verify(self, bs: int) -> None:
        """Raises ``RuntimeError`` unless a dummy batch of ``bs - 1`` rows (1 when bs == 1) through the runner
        gives eager's logits within ``VERIFY_RTOL`` (of their scale). Uses free pages and rows, and leaves them as
        it found them."""
        n = max(1, bs - 1)
        ps = self.kv_pool.page_size
        pages_per_req = max(1, min(3, self.kv_pool.num_pages // n))
        # Own generators, not the global RNG: sampling seeds stay as configured.
        gen = torch.Generator().manual_seed(bs)
        dev_gen = torch.Generator(device=self.device).manual_seed(bs)
        seq_lens = torch.randint(1, pages_per_req * ps + 1, (n,), generator=gen)
        rows = torch.arange(n)
        slots = 1 * ps + torch.arange(n * pages_per_req * ps).view(n, -1)  # pages 1.. in request order
        table = self.req_to_token_pool.device_req_to_token
        saved_rows = table[:n, : slots.shape[1]].clone()
        used = slots.reshape(-1).to(self.device)
        try:
            table[:n, : slots.shape[1]] = slots.to(self.device)
            for layer in range(self.kv_pool.num_layers):
                for buf in (self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer]):
                    buf[used] = torch.randn(used.numel(), *buf.shape[1:], generator=dev_gen, device=self.device,
                                            dtype=buf.dtype)
            ids = torch.randint(0, self.model.config.vocab_size, (n,), generator=gen)
            loc = slots.gather(1, (seq_lens - 1)[:, None]).squeeze(1)
            dev = [t.to(self.device) for t in (ids, seq_lens - 1, loc, rows, seq_lens)]
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=n, input_ids=dev[0], positions=dev[1],
                out_cache_loc=dev[2], req_pool_indices=dev[3], seq_lens=dev[4],
                extend_lens=torch.ones(n, dtype=torch.int64, device=self.device), prefix_lens=dev[1],
                req_to_token=table, seq_lens_cpu=seq_lens.tolist(), extend_lens_cpu=[1] * n,
                prefix_lens_cpu=(seq_lens - 1).tolist(), kv_pool=self.kv_pool, attn_backend=self.eager_backend,
            )
            if self.use_cuda_graph:  # the graph's split count: eager then runs the very same kernels
                fb.attn_metadata = self._graph_batches[bs].attn_metadata
            else:
                self.eager_backend.init_forward_metadata(fb)  # type: ignore[attr-defined]
            want = self.model.compute_logits(self.model.forward(fb))
            self._load(fb, n, bs)
            if self.use_cuda_graph:
                self._graphs[bs].replay()
                hidden = self._graph_out[bs][:n]
            else:
                hidden = self._run_compiled(bs, int(seq_lens.max()))[:n]
            got = self.model.compute_logits(hidden)
        finally:
            table[:n, : slots.shape[1]] = saved_rows
            for layer in range(self.kv_pool.num_layers):
                self.kv_pool.k_buffer[layer][used] = 0
                self.kv_pool.v_buffer[layer][used] = 0
        if not bool(torch.isfinite(got).all()):
            raise RuntimeError(f"batch size {bs}: non-finite logits")
        err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
        if err > VERIFY_RTOL[self.dtype]:
            raise RuntimeError(f"batch size {bs}: logits differ from eager by {err:.3g} of their scale "
                               f"(> {VERIFY_RTOL[self.dtype]})")


def build_graph_runner(
    args: ServerArgs,
    model: LlamaForCausalLM,
    kv_pool: MHATokenToKVPool,
    req_to_token_pool: ReqToTokenPool,
    eager_backend: object,
) -> DecodeGraphRunner | None:
    """The runner the flags ask for, warmed up; ``None`` (decode runs eagerly) when none is asked for or every
    option failed its start-up check (each failure logged as a warning with its reason)."""
    if args.disaggregation_mode == "prefill":
        return None  # prefill nodes run no decode steps
    options: list[tuple[bool, int]] = []  # (CUDA graphs, compile_max_bs), the first that passes wins
    compile_bs = args.torch_compile_max_bs if args.enable_torch_compile else 0
    graphs = args.use_cuda_graph and kv_pool.device.type == "cuda"
    if graphs and args.resolved_attention_backend != "triton":
        logger.warning("CUDA graphs off: they need --attention-backend triton (got %s)", args.attention_backend)
        graphs = False
    if args.device == "cuda" and args.tp_size > 1 and not args.disable_cuda_graph:
        logger.warning("CUDA graphs off: not supported with --tp-size %d yet", args.tp_size)
    if graphs:
        options.append((True, compile_bs))
        if compile_bs:
            options.append((True, 0))
    elif compile_bs:
        options.append((False, compile_bs))
    for use_graphs, compile_max_bs in options:
        runner = DecodeGraphRunner(args, model, kv_pool, req_to_token_pool, eager_backend, use_graphs,
                                   compile_max_bs)
        try:
            with torch.inference_mode():  # the mode serving runs in (dynamo guards on it)
                if kv_pool.device.type == "cuda":
                    with torch.cuda.device(kv_pool.device):
                        runner.warm_up()
                else:
                    runner.warm_up()
        # NOTE: whatever breaks a capture or a compile (CUDA, Triton, dynamo, inductor errors) must leave a node
        # that serves eagerly; the reason is logged, nothing is swallowed silently.
        except Exception as exc:
            logger.warning("decode %s failed at start-up, falling back: %s: %s",
                           "CUDA graphs" if use_graphs else "torch.compile", type(exc).__name__, exc)
            if kv_pool.device.type == "cuda":
                torch.cuda.synchronize(kv_pool.device)
            continue
        return runner
    if options:
        logger.warning("decode steps run eagerly")
    return None
