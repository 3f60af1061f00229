"""``VerifyGraphRunner``: ``TARGET_VERIFY`` forwards replayed as CUDA graphs and/or run through ``torch.compile``.

A verify batch of ``n`` requests, request i with ``e_i <= N`` rows (its last token and its drafts; ``N`` =
``--speculative-num-draft-tokens``, the most a request verifies), runs at the smallest bucket ``bs >= n`` as
``bs x N`` rows, always in the tree form (a chain is the tree whose mask is lower-triangular)::

    rows i * N + j:        j < e_i (request i's)           e_i <= j < N (padding)      i >= n (padding requests)
    input_ids              its token                       0                           0
    positions              its position                    C_i                         0
    out_cache_loc          its KV slot                     0 (the padding page)        0
    mask[i, j, :]          its block (tree / causal)       itself only                 itself only
    per request            req_pool_indices, prefix_lens = C_i (committed), seq_lens = C_i + N;
                           padding requests: padding_row, 0, N

A padding row writes only slot 0 of the padding page and no real row sees it; it reads new keys ``req_to_token``
holds past a request's rows (stale slots of finite K/V, or slot 0), so it stays finite. Its outputs are dropped:
``forward_features`` returns the real rows in the batch's token order. The Triton extend kernel reads the new keys
at ``req_to_token[row, C_i + k]``, so a batch runs here only if ``C_i + N`` fits the table's width.

Modes and the start-up check as ``DecodeGraphRunner`` (``common.engine.graph_base``): the check runs a dummy batch
of random trees of 1 .. N rows on free pages eagerly and through the runner.

The decode-time draft extends (``common.engine.spec.draft_extend_graph_runner``) are this layout with causal chains,
another model (the draft model, EAGLE's head) and, for the head, a static input beside the batch
(``_step_extras``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from common.config import ServerArgs
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.graph_base import StepGraphRunner, build_step_runner, capture_max_bs, check_close
from common.engine.graph_runner import model_step, split_out
from common.engine.model.padded_decode_backend import padded_page_table
from common.engine.model.padded_verify_backend import PaddedVerifyBackend, PaddedVerifyMetadata
from common.engine.spec.tree import tree_positions_and_mask

if TYPE_CHECKING:
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from common.engine.model.llama import LlamaForCausalLM


class VerifyGraphRunner(StepGraphRunner):
    kind = "verify"
    forward_mode = ForwardMode.TARGET_VERIFY
    check_features = False  # the start-up check compares the step's second output too (always with ``capture``)

    def __init__(self, args: ServerArgs, model: Any, kv_pool: MHATokenToKVPool, req_to_token_pool: ReqToTokenPool,
                 eager_backend: Any, use_cuda_graph: bool, compile_max_bs: int, num_rows: int,
                 capture: frozenset[int] = frozenset(), step: Callable[..., Any] | None = None) -> None:
        """``num_rows``: N, rows per request (``--speculative-num-draft-tokens``); ``step``: the step function
        (default: the target's, ``model_step(capture)``)."""
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.eager_backend = eager_backend
        self.capture = capture
        self.num_rows = num_rows
        max_bs = capture_max_bs(args, use_cuda_graph, compile_max_bs, args.max_running_requests, kv_pool.num_pages)
        super().__init__(max_bs, kv_pool.device, kv_pool.dtype, use_cuda_graph, compile_max_bs,
                         model_step(capture) if step is None else step)
        self.padded_backend = self._padded_backend()
        n, dev = num_rows, self.device
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(max_bs * n, **i64)
        self.positions = torch.zeros(max_bs * n, **i64)
        self.out_cache_loc = torch.zeros(max_bs * n, **i64)
        self.req_pool_indices = torch.full((max_bs,), req_to_token_pool.padding_row, **i64)
        self.prefix_lens = torch.zeros(max_bs, **i64)
        self.seq_lens = torch.full((max_bs,), n, **i64)
        self.extend_lens = torch.full((max_bs,), n, **i64)
        self.q_start = torch.arange(max_bs, **i64) * n
        self.mask_start = torch.arange(max_bs, **i64) * n * n
        self._eye = torch.eye(n, dtype=torch.bool, device=dev).repeat(max_bs, 1, 1).reshape(-1)
        self.mask = self._eye.clone()  # bool [max_bs * N * N]
        self._graph_batches: dict[int, ForwardBatch] = {}

    def _padded_backend(self) -> PaddedVerifyBackend:
        cfg = self.model.config
        return PaddedVerifyBackend(self.model.shard.num_heads, self.model.shard.num_kv_heads, cfg.head_dim,
                                   self.kv_pool.page_size, cfg.sliding_window)

    def _vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def _step_extras(self, bs: int) -> tuple[torch.Tensor, ...]:
        """Static inputs the step takes after (model, batch), ``bs * N`` rows each (none for the target)."""
        return ()

    # -- serving ---------------------------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.forward_mode == self.forward_mode and 0 < fb.batch_size <= self.max_bs
                and max(fb.extend_lens_cpu) <= self.num_rows
                and max(fb.prefix_lens_cpu) + self.num_rows <= self.req_to_token_pool.device_req_to_token.shape[1])

    def forward_features(self, fb: ForwardBatch, bucket: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, features) of every row of the verify batch, in its token order (views of static buffers under
        CUDA graphs: read them before the next call), run at ``bucket`` (default: the smallest that holds it).
        Writes the rows' K/V like ``model.forward``."""
        n = fb.batch_size
        bs = self._bucket(n) if bucket is None else bucket
        return self._run_rows(fb, bs, self._load(fb, n, bs))

    def _run_rows(self, fb: ForwardBatch, bs: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step over the loaded buffers at ``bs``: (hidden, features) of ``rows`` (the batch's own)."""
        out = self._replay(bs) if self.use_cuda_graph else self._run_compiled(bs, max(fb.prefix_lens_cpu))
        hidden, features = split_out(out)
        return hidden.index_select(0, rows), features.index_select(0, rows)

    def _load(self, fb: ForwardBatch, n: int, bs: int) -> torch.Tensor:
        """Copies ``fb`` into the static buffers (padding as the module docstring); returns the padded row of each
        of its tokens."""
        big_n = self.num_rows
        ext = fb.extend_lens_cpu
        rows = [i * big_n + j for i, e in enumerate(ext) for j in range(e)]
        if fb.custom_mask is None:  # a chain: row j sees rows 0 .. j
            cells = [i * big_n * big_n + j * big_n + k for i, e in enumerate(ext) for j in range(e) for k in range(j + 1)]
        else:  # the tree's blocks, in custom_mask's order
            cells = [i * big_n * big_n + j * big_n + k for i, e in enumerate(ext) for j in range(e) for k in range(e)]
        index = torch.tensor(rows + cells, dtype=torch.int64).to(self.device, non_blocking=True)
        rows_t, cells_t = index[: len(rows)], index[len(rows):]
        t = bs * big_n
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        self.prefix_lens[:n].copy_(fb.prefix_lens)
        if n < bs:
            self.req_pool_indices[n:bs].fill_(self.req_to_token_pool.padding_row)
            self.prefix_lens[n:bs].zero_()
        torch.add(self.prefix_lens[:bs], big_n, out=self.seq_lens[:bs])
        self.input_ids[:t].zero_()
        self.input_ids.index_copy_(0, rows_t, fb.input_ids)
        self.positions[:t].view(bs, big_n).copy_(self.prefix_lens[:bs, None].expand(bs, big_n))
        self.positions.index_copy_(0, rows_t, fb.positions)
        self.out_cache_loc[:t].zero_()
        self.out_cache_loc.index_copy_(0, rows_t, fb.out_cache_loc)
        mask = self.mask[: t * big_n]
        mask.copy_(self._eye[: t * big_n])
        if fb.custom_mask is None:
            mask.index_fill_(0, cells_t, True)
        else:
            mask.index_copy_(0, cells_t, fb.custom_mask.to(torch.bool))
        return rows_t

    def _static_batch(self, bs: int, backend: Any, metadata: Any) -> ForwardBatch:
        t = bs * self.num_rows
        return ForwardBatch(
            forward_mode=self.forward_mode, batch_size=bs, input_ids=self.input_ids[:t],
            positions=self.positions[:t], out_cache_loc=self.out_cache_loc[:t],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            extend_lens=self.extend_lens[:bs], prefix_lens=self.prefix_lens[:bs],
            req_to_token=self.req_to_token_pool.device_req_to_token,
            seq_lens_cpu=[], extend_lens_cpu=[], prefix_lens_cpu=[],  # not read: every operand is a tensor
            kv_pool=self.kv_pool, attn_backend=backend, attn_metadata=metadata,
            custom_mask=self.mask[: t * self.num_rows],
        )

    def _run_compiled(self, bs: int, max_prefix: int) -> Any:
        ps, big_n = self.kv_pool.page_size, self.num_rows
        # NOTE: at least 2 pages, so the dynamic dim never takes the 0/1 values that dynamo specializes on.
        num_pages = max(2, -(-(max_prefix + big_n) // ps))
        table = padded_page_table(self.req_to_token_pool.device_req_to_token, self.req_pool_indices[:bs],
                                  num_pages, ps)
        torch._dynamo.mark_dynamic(table, 1)
        mask = self.mask[: bs * big_n * big_n].view(bs, big_n, big_n)
        fb = self._static_batch(bs, self.padded_backend, PaddedVerifyMetadata(table, self.prefix_lens[:bs], mask))
        return self._call_compiled(self.model, fb, *self._step_extras(bs))

    # -- start-up (the loop: StepGraphRunner.warm_up) ----------------------------------------------------------------
    def _capture_inputs(self, bs: int) -> tuple[Any, tuple[Any, ...]]:
        from common.engine.model.triton_backend import TritonAttnMetadata

        t = bs * self.num_rows
        # Padding only, as a replay without a batch would see (the previous bucket's check left its rows here).
        self.input_ids[:t].zero_()
        self.positions[:t].zero_()
        self.out_cache_loc[:t].zero_()
        self.req_pool_indices[:bs].fill_(self.req_to_token_pool.padding_row)
        self.prefix_lens[:bs].zero_()
        self.seq_lens[:bs].fill_(self.num_rows)
        self.mask[: t * self.num_rows].copy_(self._eye[: t * self.num_rows])
        md = TritonAttnMetadata(False, 1, self.q_start[:bs], self.num_rows,
                                custom_mask=self.mask[: t * self.num_rows].view(torch.uint8),
                                mask_start=self.mask_start[:bs])
        fb = self._static_batch(bs, self.eager_backend, md)
        self._graph_batches[bs] = fb
        return self._step_fn(bs), (self.model, fb, *self._step_extras(bs))

    def _dummy_extras(self, num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        """Random values of the step's extra inputs (``_step_extras``) for the start-up check's ``num_tokens`` rows."""
        return ()

    def _serve(self, fb: ForwardBatch, bs: int, extras: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, features) of ``fb`` through the runner at ``bs``: the serving call the start-up check compares."""
        return self.forward_features(fb, bs)

    def _verify(self, bs: int) -> None:
        """Raises ``RuntimeError`` unless a dummy batch of ``bs - 1`` requests (1 when bs == 1) of 1 .. N rows (trees
        for a verify, chains for an extend) gives eager's logits through the runner. Uses free pages and rows and
        restores them."""
        n, big_n, ps = max(1, bs - 1), self.num_rows, self.kv_pool.page_size
        pages_per_req = -(-(big_n + 2 * ps) // ps)
        width = pages_per_req * ps
        if n * pages_per_req > self.kv_pool.num_pages or width > self.req_to_token_pool.device_req_to_token.shape[1]:
            raise RuntimeError(f"{self.kind} batch size {bs}: the KV pool is too small for the start-up check")
        gen = torch.Generator().manual_seed(bs)
        dev_gen = torch.Generator(device=self.device).manual_seed(bs)
        ext = [big_n if i == 0 else int(torch.randint(1, big_n + 1, (1,), generator=gen)) for i in range(n)]
        committed = [int(torch.randint(1, width - e + 1, (1,), generator=gen)) for e in ext]
        trees = []
        for e in ext:  # random parents: each draft under an earlier node (the first request: a chain)
            parents = [j - 1 if len(trees) == 0 else int(torch.randint(-1, j, (1,), generator=gen)) for j in range(e - 1)]
            trees.append(([0] * (e - 1), parents))
        if self.forward_mode == ForwardMode.TARGET_VERIFY:
            positions, custom_mask = tree_positions_and_mask(committed, trees)
        else:  # an extend: each request's rows causal after its prefix
            positions = [c + j for c, e in zip(committed, ext, strict=True) for j in range(e)]
            custom_mask = None
        slots = ps + torch.arange(n * width).view(n, width)  # pages 1.. in request order
        table = self.req_to_token_pool.device_req_to_token
        saved = table[:n, :width].clone()
        used = slots.reshape(-1).to(self.device)
        try:
            table[:n, :width] = slots.to(self.device)
            for layer in range(self.kv_pool.num_layers):
                for buf in (self.kv_pool.k_buffer[layer], self.kv_pool.v_buffer[layer]):
                    buf[used] = torch.randn(used.numel(), *buf.shape[1:], generator=dev_gen, device=self.device,
                                            dtype=buf.dtype)
            ids = torch.randint(0, self._vocab_size(), (sum(ext),), generator=gen)
            extras = self._dummy_extras(sum(ext), gen)
            loc = torch.cat([slots[i, c : c + e] for i, (c, e) in enumerate(zip(committed, ext, strict=True))])
            seq = [c + e for c, e in zip(committed, ext, strict=True)]
            dev = [t.to(self.device) for t in (ids, torch.tensor(positions), loc, torch.arange(n), torch.tensor(seq),
                                                torch.tensor(ext), torch.tensor(committed))]
            fb = ForwardBatch(
                forward_mode=self.forward_mode, batch_size=n, input_ids=dev[0], positions=dev[1],
                out_cache_loc=dev[2], req_pool_indices=dev[3], seq_lens=dev[4], extend_lens=dev[5],
                prefix_lens=dev[6], req_to_token=table, seq_lens_cpu=seq, extend_lens_cpu=ext,
                prefix_lens_cpu=committed, kv_pool=self.kv_pool, attn_backend=self.eager_backend,
                custom_mask=None if custom_mask is None else custom_mask.to(self.device),
            )
            self.eager_backend.init_forward_metadata(fb)
            want_hidden, want_features = split_out(self._step(self.model, fb, *extras))
            want, want_features = self.model.compute_logits(want_hidden), want_features.clone()
            hidden, features = self._serve(fb, bs, extras)
            got, got_features = self.model.compute_logits(hidden), features.clone()
        finally:
            table[:n, :width] = saved
            for layer in range(self.kv_pool.num_layers):
                self.kv_pool.k_buffer[layer][used] = 0
                self.kv_pool.v_buffer[layer][used] = 0
                self.kv_pool.k_buffer[layer][:ps] = 0  # the padding rows' writes
                self.kv_pool.v_buffer[layer][:ps] = 0
        check_close(f"{self.kind} batch size {bs}", got, want, self.dtype)
        if self.capture or self.check_features:
            check_close(f"{self.kind} batch size {bs} (features)", got_features, want_features, self.dtype)


def build_verify_graph_runner(args: ServerArgs, model: LlamaForCausalLM, kv_pool: MHATokenToKVPool,
                              req_to_token_pool: ReqToTokenPool, eager_backend: Any, num_rows: int,
                              capture: frozenset[int] = frozenset()) -> VerifyGraphRunner | None:
    """The verify runner the flags ask for, warmed up, or ``None`` (verify forwards run eagerly)."""

    def make(use_graphs: bool, compile_max_bs: int) -> VerifyGraphRunner:
        return VerifyGraphRunner(args, model, kv_pool, req_to_token_pool, eager_backend, use_graphs, compile_max_bs,
                                 num_rows, capture)

    return build_step_runner(args, kv_pool.device, "verify", make)
