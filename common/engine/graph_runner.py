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

With ``capture`` (EAGLE3's target layers) the step returns the captured residual streams beside the hidden
states (``forward_capture``), so the EAGLE hook reads every replayed decode step's features.

Safety: after each bucket is captured/compiled, a dummy batch (random K/V on free pages, ``n < bs`` rows so padding
is exercised) runs eagerly and through the runner; a failure to capture/compile, non-finite logits or logits
further than ``VERIFY_RTOL`` (of their scale) from eager log a warning with the reason, and decode runs eagerly
instead. The shared machinery (buckets, capture, modes, fallback): ``common.engine.graph_base``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.config import ServerArgs
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.graph_base import (
    VERIFY_RTOL,
    StepGraphRunner,
    batch_size_buckets,
    build_step_runner,
    capture_max_bs,
    check_close,
)
from common.engine.model.padded_decode_backend import (
    PaddedDecodeBackend,
    PaddedDecodeMetadata,
    padded_page_table,
)

if TYPE_CHECKING:
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from common.engine.model.llama import LlamaForCausalLM

__all__ = ["VERIFY_RTOL", "DecodeGraphRunner", "batch_size_buckets", "build_graph_runner", "model_step"]


def _decode_hidden(model: LlamaForCausalLM, fb: ForwardBatch) -> torch.Tensor:
    """What is compiled and captured: the decode forward up to the final norm's hidden states."""
    return model.forward(fb)


def model_step(capture: frozenset[int]) -> Callable[[LlamaForCausalLM, ForwardBatch], object]:
    """The target's step function: hidden states, or (hidden, captured streams) with ``capture``."""
    if not capture:
        return _decode_hidden

    def _forward_capture(model: LlamaForCausalLM, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return model.forward_capture(fb, capture)

    return _forward_capture


def split_out(out: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, features) of a step's output (features are the hidden states without a capture)."""
    if isinstance(out, tuple):
        return out
    assert isinstance(out, torch.Tensor)
    return out, out


class DecodeGraphRunner(StepGraphRunner):
    kind = "decode"

    def __init__(
        self,
        args: ServerArgs,
        model: LlamaForCausalLM,
        kv_pool: MHATokenToKVPool,
        req_to_token_pool: ReqToTokenPool,
        eager_backend: object,
        use_cuda_graph: bool,
        compile_max_bs: int,
        capture: frozenset[int] = frozenset(),
    ) -> None:
        """``compile_max_bs``: buckets up to it run the compiled forward (0: nothing compiled). Builds buffers
        only; ``warm_up`` captures/compiles and raises if any bucket fails its check."""
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.eager_backend = eager_backend
        self.capture = capture
        # NOTE: each request of a batch holds a page of its own, so no batch is larger than the pool's pages.
        max_bs = capture_max_bs(args, use_cuda_graph, compile_max_bs, args.max_running_requests, kv_pool.num_pages)
        super().__init__(max_bs, kv_pool.device, kv_pool.dtype, use_cuda_graph, compile_max_bs, model_step(capture))
        cfg = model.config
        self.padded_backend = PaddedDecodeBackend(
            model.shard.num_heads, model.shard.num_kv_heads, cfg.head_dim, kv_pool.page_size, cfg.sliding_window
        )
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.out_cache_loc = torch.zeros(max_bs, **i64)
        self.req_pool_indices = torch.full((max_bs,), req_to_token_pool.padding_row, **i64)
        self.seq_lens = torch.ones(max_bs, **i64)
        self.extend_lens = torch.ones(max_bs, **i64)
        self._graph_batches: dict[int, ForwardBatch] = {}

    # -- serving ---------------------------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode == ForwardMode.DECODE and fb.batch_size <= self.max_bs

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode batch (a view of a static buffer under CUDA graphs: read it before
        the next call). Writes the new tokens' K/V like ``model.forward``."""
        return self.forward_features(fb)[0]

    def forward_features(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, features) [n, ...] of a decode batch (``split_out``)."""
        n = fb.batch_size
        bs = self._bucket(n)
        self._load(fb, n, bs)
        out = self._replay(bs) if self.use_cuda_graph else self._run_compiled(bs, max(fb.seq_lens_cpu))
        hidden, features = split_out(out)
        return hidden[:n], features[:n]

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

    def _run_compiled(self, bs: int, max_seq_len: int) -> object:
        assert self._compiled is not None
        ps = self.kv_pool.page_size
        # NOTE: at least 2 pages, so the dynamic dim never takes the 0/1 values that dynamo specializes on.
        num_pages = max(2, -(-max_seq_len // ps))
        table = padded_page_table(self.req_to_token_pool.device_req_to_token, self.req_pool_indices[:bs],
                                  num_pages, ps)
        torch._dynamo.mark_dynamic(table, 1)
        fb = self._static_batch(bs, self.padded_backend, PaddedDecodeMetadata(table, self.seq_lens[:bs]))
        # Batch dims stay static per bucket (one graph each); the page-table width is the one dynamic dim.
        return self._call_compiled(self.model, fb)

    # -- start-up (the loop: StepGraphRunner.warm_up) ---------------------------------------------------------
    def _capture_inputs(self, bs: int) -> tuple[Callable[..., object], tuple[object, ...]]:
        """The function a bucket's graph captures and its static batch (padding rows only, until replayed)."""
        from common.engine.model.triton_backend import TritonAttnMetadata

        backend = self.eager_backend
        # NOTE: a graph fixes the grid (by batch size alone); each request still takes the splits its own length
        # asks for, on the device (common/engine/kernels/decode_attention.py).
        splits = backend.grid_kv_splits(bs)  # type: ignore[attr-defined]
        fb = self._static_batch(bs, backend, TritonAttnMetadata(True, splits, None, 1))
        self._pad(0, bs)
        self._graph_batches[bs] = fb
        return self._step_fn(bs), (self.model, fb)

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
            want_hidden, want_features = split_out(self._step(self.model, fb))
            want = self.model.compute_logits(want_hidden)
            want_features = want_features.clone()
            self._load(fb, n, bs)
            hidden, features = split_out(self._replay(bs) if self.use_cuda_graph
                                         else self._run_compiled(bs, int(seq_lens.max())))
            got = self.model.compute_logits(hidden[:n])
            got_features = features[:n].clone()
        finally:
            table[:n, : slots.shape[1]] = saved_rows
            for layer in range(self.kv_pool.num_layers):
                self.kv_pool.k_buffer[layer][used] = 0
                self.kv_pool.v_buffer[layer][used] = 0
        check_close(f"batch size {bs}", got, want, self.dtype)
        if self.capture:
            check_close(f"batch size {bs} (captured streams)", got_features, want_features, self.dtype)


def build_graph_runner(
    args: ServerArgs,
    model: LlamaForCausalLM,
    kv_pool: MHATokenToKVPool,
    req_to_token_pool: ReqToTokenPool,
    eager_backend: object,
    capture: frozenset[int] = frozenset(),
) -> DecodeGraphRunner | None:
    """The runner the flags ask for, warmed up; ``None`` (decode runs eagerly) when none is asked for or every
    option failed its start-up check (each failure logged as a warning with its reason)."""

    def make(use_graphs: bool, compile_max_bs: int) -> DecodeGraphRunner:
        return DecodeGraphRunner(args, model, kv_pool, req_to_token_pool, eager_backend, use_graphs, compile_max_bs,
                                 capture)

    return build_step_runner(args, kv_pool.device, "decode", make)
