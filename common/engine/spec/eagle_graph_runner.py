"""``DraftGraphRunner``: EAGLE's draft steps (``EagleWorker.draft``: the head's decode forwards of ``bs * topk``
branch rows) replayed as CUDA graphs and/or run through ``torch.compile``.

A draft step of ``n`` requests runs at the smallest bucket ``bs >= n`` as ``bs * topk`` rows. Each row reads its keys
through its own row of a branch table (the request's committed slots, then its chain of scratch slots), copied into
a static table of the widest a step can need (the target's ``req_to_token`` width + ``num_steps`` columns)::

    row:              | 0 .. n*topk-1: the branches          | n*topk .. bs*topk-1: padding |
    input_ids         | the branch's token                   | 0                            |
    positions         | seq_len - 1                          | 0                            |
    out_cache_loc     | its scratch slot                     | 0 (the padding page)         |
    seq_lens          | committed + step                     | 1                            |
    table row         | its branch table row                 | zeros (slot 0)               |
    hidden            | the parent's feature                 | 0                            |

so a padded row reads and writes only slot 0 of the head pool's padding page. The graph computes the head's
(logit hidden, feature); the top-k after it runs as before. Compiled (any device), the rows attend through
``PaddedDecodeBackend`` at slot granularity (the scratch chain is not page-aligned). The start-up check runs a dummy
step eagerly and through the runner (``common.engine.graph_base``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from common.config import ServerArgs
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.graph_base import StepGraphRunner, build_step_runner, capture_max_bs, check_close
from common.engine.model.padded_decode_backend import PaddedDecodeBackend, PaddedDecodeMetadata

if TYPE_CHECKING:
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.spec.eagle_model import EagleHead


def head_step(head: EagleHead, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return head(fb, hidden)


class DraftGraphRunner(StepGraphRunner):
    kind = "EAGLE draft"

    def __init__(self, args: ServerArgs, head: EagleHead, kv_pool: MHATokenToKVPool, eager_backend: Any, topk: int,
                 max_batch: int, table_width: int, use_cuda_graph: bool, compile_max_bs: int) -> None:
        """The ``EagleWorker``'s head, head pool, eager backend, topk and largest batch; ``table_width``: columns
        of the widest branch table a step builds."""
        self.head = head
        self.kv_pool = kv_pool
        self.eager_backend = eager_backend
        self.topk = topk
        max_bs = capture_max_bs(args, use_cuda_graph, compile_max_bs, max_batch)
        super().__init__(max_bs, self.kv_pool.device, self.kv_pool.dtype, use_cuda_graph, compile_max_bs, head_step)
        lc = self.head.config.layer
        self.padded_backend = PaddedDecodeBackend(self.head.shard.num_heads, self.head.shard.num_kv_heads, lc.head_dim,
                                                  1, None)
        rows, dev = max_bs * self.topk, self.device
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(rows, **i64)
        self.positions = torch.zeros(rows, **i64)
        self.out_cache_loc = torch.zeros(rows, **i64)
        self.seq_lens = torch.ones(rows, **i64)
        self.extend_lens = torch.ones(rows, **i64)
        self.req_pool_indices = torch.arange(rows, **i64)
        self.table = torch.zeros(rows, table_width, **i64)
        self.hidden = torch.zeros(rows, self.head.hidden_size, dtype=self.head.fc.weight.dtype, device=dev)
        self._graph_batches: dict[int, ForwardBatch] = {}

    # -- serving ---------------------------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.batch_size <= self.max_bs * self.topk and fb.req_to_token.shape[1] <= self.table.shape[1]

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor, bucket: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's (logit hidden, feature) [rows, hidden] of a draft step ``fb`` (branch rows, its table in
        ``fb.req_to_token``), run at ``bucket`` (default: the smallest that holds it); views of static buffers under
        CUDA graphs: read them before the next call."""
        rows = fb.batch_size
        bs = self._bucket(-(-rows // self.topk)) if bucket is None else bucket
        self._load(fb, hidden, rows, bs * self.topk)
        if self.use_cuda_graph:
            logit_h, feature = self._replay(bs)
        else:
            logit_h, feature = self._run_compiled(bs, max(fb.seq_lens_cpu))
        return logit_h[:rows], feature[:rows]

    def _load(self, fb: ForwardBatch, hidden: torch.Tensor, rows: int, padded: int) -> None:
        self.input_ids[:rows].copy_(fb.input_ids)
        self.positions[:rows].copy_(fb.positions)
        self.out_cache_loc[:rows].copy_(fb.out_cache_loc)
        self.seq_lens[:rows].copy_(fb.seq_lens)
        self.table[:rows, : fb.req_to_token.shape[1]].copy_(fb.req_to_token)
        self.hidden[:rows].copy_(hidden)
        if rows < padded:
            self._pad(rows, padded)

    def _pad(self, start: int, end: int) -> None:
        for buf in (self.input_ids, self.positions, self.out_cache_loc, self.table, self.hidden):
            buf[start:end].zero_()
        self.seq_lens[start:end].fill_(1)

    def _static_batch(self, bs: int, backend: Any, metadata: Any) -> ForwardBatch:
        r = bs * self.topk
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=r, input_ids=self.input_ids[:r], positions=self.positions[:r],
            out_cache_loc=self.out_cache_loc[:r], req_pool_indices=self.req_pool_indices[:r],
            seq_lens=self.seq_lens[:r], extend_lens=self.extend_lens[:r], prefix_lens=self.positions[:r],
            req_to_token=self.table, seq_lens_cpu=[], extend_lens_cpu=[], prefix_lens_cpu=[],
            kv_pool=self.kv_pool, attn_backend=backend, attn_metadata=metadata,
        )

    def _run_compiled(self, bs: int, max_seq_len: int) -> Any:
        r = bs * self.topk
        # NOTE: at least 2 columns, so the dynamic dim never takes the 0/1 values that dynamo specializes on.
        width = max(2, max_seq_len)
        table = self.table[:r, :width].clone()
        torch._dynamo.mark_dynamic(table, 1)
        fb = self._static_batch(bs, self.padded_backend, PaddedDecodeMetadata(table, self.seq_lens[:r]))
        return self._call_compiled(self.head, fb, self.hidden[:r])

    # -- start-up (the loop: StepGraphRunner.warm_up) ----------------------------------------------------------------
    def _capture_inputs(self, bs: int) -> tuple[Any, tuple[Any, ...]]:
        from common.engine.model.triton_backend import TritonAttnMetadata

        r = bs * self.topk
        splits = self.eager_backend.grid_kv_splits(r)
        fb = self._static_batch(bs, self.eager_backend, TritonAttnMetadata(True, splits, None, 1))
        self._pad(0, r)
        self._graph_batches[bs] = fb
        return self._step_fn(bs), (self.head, fb, self.hidden[:r])

    def _verify(self, bs: int) -> None:
        """Raises ``RuntimeError`` unless a dummy draft step of ``(bs - 1) * topk`` rows (``topk`` when bs == 1) on
        free head slots gives eager's logits through the runner; the slots are zeroed again."""
        n = max(1, bs - 1) * self.topk
        ps = self.kv_pool.page_size
        width = min(self.table.shape[1], 3 * ps + 2)
        slots_needed = n * width
        if ps + slots_needed > self.kv_pool.k_buffer[0].shape[0]:
            raise RuntimeError(f"{self.kind} batch size {bs}: the head's KV pool is too small for the start-up check")
        gen = torch.Generator().manual_seed(bs)
        dev_gen = torch.Generator(device=self.device).manual_seed(bs)
        seq = torch.randint(1, width + 1, (n,), generator=gen)
        table = (ps + torch.arange(slots_needed).view(n, width)).to(self.device)
        used = table.reshape(-1)
        pool = self.kv_pool
        try:
            for buf in (pool.k_buffer[0], pool.v_buffer[0]):
                buf[used] = torch.randn(used.numel(), *buf.shape[1:], generator=dev_gen, device=self.device,
                                        dtype=buf.dtype)
            ids = torch.randint(0, self.head.target.config.vocab_size, (n,), generator=gen).to(self.device)
            hidden = torch.randn(n, self.head.hidden_size, generator=gen).to(self.device, self.hidden.dtype)
            seq_d = seq.to(self.device)
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=n, input_ids=ids, positions=seq_d - 1,
                out_cache_loc=table.gather(1, (seq_d - 1)[:, None]).squeeze(1), req_pool_indices=torch.arange(
                    n, device=self.device), seq_lens=seq_d, extend_lens=torch.ones_like(seq_d), prefix_lens=seq_d - 1,
                req_to_token=table, seq_lens_cpu=seq.tolist(), extend_lens_cpu=[1] * n,
                prefix_lens_cpu=(seq - 1).tolist(), kv_pool=pool, attn_backend=self.eager_backend,
            )
            if self.use_cuda_graph:  # the graph's split count: eager then runs the very same kernels
                fb.attn_metadata = self._graph_batches[bs].attn_metadata
            want_h, want_f = self.head(fb, hidden)
            want, want_f = self.head.compute_logits(want_h), want_f.clone()
            got_h, got_f = self.forward(fb, hidden, bs)
            got, got_f = self.head.compute_logits(got_h), got_f.clone()
        finally:
            for buf in (pool.k_buffer[0], pool.v_buffer[0]):
                buf[used] = 0
                buf[:ps] = 0
        check_close(f"{self.kind} batch size {bs}", got, want, self.dtype)
        check_close(f"{self.kind} batch size {bs} (features)", got_f, want_f, self.dtype)


def build_draft_graph_runner(args: ServerArgs, head: EagleHead, kv_pool: MHATokenToKVPool, eager_backend: Any,
                             topk: int, max_batch: int, num_steps: int, table_width: int) -> DraftGraphRunner | None:
    """The draft-step runner the flags ask for, warmed up, or ``None`` (draft steps run eagerly; also when a step
    has no draft forward: ``num_steps`` 1)."""
    if num_steps < 2:
        return None

    def make(use_graphs: bool, compile_max_bs: int) -> DraftGraphRunner:
        return DraftGraphRunner(args, head, kv_pool, eager_backend, topk, max_batch, table_width, use_graphs,
                                compile_max_bs)

    return build_step_runner(args, kv_pool.device, "EAGLE draft", make)
