"""Decode-time ``DRAFT_EXTEND`` forwards replayed as CUDA graphs and/or run through ``torch.compile``: the STANDALONE
draft model's extend over the tokens a verify accepted (``DraftExtendGraphRunner``, served by the draft's
``ModelRunner``) and EAGLE's head extend over the rows a verify / decode step committed (``EagleExtendGraphRunner``,
served by ``EagleWorker.extend``).

After a verify every request extends by a bounded number of rows, so a batch of ``n`` requests runs at the smallest
bucket ``bs >= n`` as ``bs x N`` rows, each request its own ``N`` (SGLang's draft-extend graphs; the padded layout,
the attention metadata built in place and the start-up check are ``VerifyGraphRunner``'s, with causal chains)::

    rows i * N + j:   j < e_i: request i's row       e_i <= j < N: padding row        i >= n: padding request
    input_ids         its token                      0                                0
    positions         its position                   its prefix length C_i            0
    out_cache_loc     its KV slot                    0 (slot 0 of the padding page)   0
    mask              causal within the request      itself only                      itself only
    hidden (EAGLE)    the target's feature           0                                0

A padding row writes only slot 0 of the padding page, which no request owns, and no real row sees it; its output
is dropped. Rows per request ``N``:

    EAGLE / EAGLE3    num_steps + 1: the verified token and the accepted path (at most one node per tree level);
                      1 after a plain decode step
    STANDALONE        ``STANDALONE_EXTEND_ROWS``: after a verify the draft has seen every accepted token but,
                      after a full accept, the last draft; so it extends over that one and the target's token

Prefill-time extends (a prompt, a prefill chunk: ``ForwardMode.EXTEND``, as SGLang's draft prefill) stay eager, as
does a decode-time one whose request has more than ``N`` rows (the draft skipped steps) or whose prefix + ``N``
passes the table's width. Flags as every step runner (``common.engine.graph_base``): ``--disable-cuda-graph``,
``--cuda-graph-max-bs``, ``--enable-torch-compile``, ``--torch-compile-max-bs``; a runner whose start-up check
fails logs a warning and the extends run eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from common.config import ServerArgs
from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.graph_base import build_step_runner
from common.engine.model.padded_verify_backend import PaddedVerifyBackend
from common.engine.spec.eagle_graph_runner import head_step
from common.engine.verify_graph_runner import VerifyGraphRunner

if TYPE_CHECKING:
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.mem.req_to_token_pool import ReqToTokenPool
    from common.engine.model.llama import LlamaForCausalLM
    from common.engine.spec.eagle_model import EagleHead

# A STANDALONE request's draft extend after a verify: its last accepted draft (only after a full accept) and the
# token the target sampled.
STANDALONE_EXTEND_ROWS = 2


class DraftExtendGraphRunner(VerifyGraphRunner):
    """The draft model's decode-time ``DRAFT_EXTEND`` batches (causal, no custom mask)."""

    kind = "draft extend"
    forward_mode = ForwardMode.DRAFT_EXTEND

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.custom_mask is None and super().can_run(fb)


class EagleExtendGraphRunner(DraftExtendGraphRunner):
    """EAGLE's head over the target's slots (``req_to_token_pool``: the target's) and the head's pool, with the
    target's features as a static input beside the batch."""

    kind = "EAGLE draft extend"
    check_features = True

    def __init__(self, args: ServerArgs, head: EagleHead, kv_pool: MHATokenToKVPool,
                 req_to_token_pool: ReqToTokenPool, eager_backend: Any, use_cuda_graph: bool, compile_max_bs: int,
                 num_rows: int) -> None:
        super().__init__(args, head, kv_pool, req_to_token_pool, eager_backend, use_cuda_graph, compile_max_bs,
                         num_rows, step=head_step)
        self.hidden = torch.zeros(self.max_bs * num_rows, head.config.target_feature_size,
                                  dtype=head.fc.weight.dtype, device=self.device)

    def _padded_backend(self) -> PaddedVerifyBackend:
        sh = self.model.shard
        return PaddedVerifyBackend(sh.num_heads, sh.num_kv_heads, self.model.config.layer.head_dim,
                                   self.kv_pool.page_size, None)

    def _vocab_size(self) -> int:
        return int(self.model.target.config.vocab_size)

    def _step_extras(self, bs: int) -> tuple[torch.Tensor, ...]:
        return (self.hidden[: bs * self.num_rows],)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.req_to_token is self.req_to_token_pool.device_req_to_token and super().can_run(fb)

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor, bucket: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's (logit hidden, feature) of every row of ``fb`` (``hidden``: the target's features of its rows)
        in its token order, run at ``bucket`` (default: the smallest that holds it). Writes the head's K/V."""
        n = fb.batch_size
        bs = self._bucket(n) if bucket is None else bucket
        rows = self._load(fb, n, bs)
        self.hidden[: bs * self.num_rows].zero_()
        self.hidden.index_copy_(0, rows, hidden.to(self.hidden.dtype))
        return self._run_rows(fb, bs, rows)

    def _capture_inputs(self, bs: int) -> tuple[Any, tuple[Any, ...]]:
        self.hidden[: bs * self.num_rows].zero_()  # padding only, as the rest of the static batch
        return super()._capture_inputs(bs)

    def _dummy_extras(self, num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        hidden = torch.randn(num_tokens, self.hidden.shape[1], generator=gen)
        return (hidden.to(self.device, self.hidden.dtype),)

    def _serve(self, fb: ForwardBatch, bs: int, extras: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward(fb, extras[0], bs)


def build_draft_extend_graph_runner(args: ServerArgs, model: LlamaForCausalLM, kv_pool: MHATokenToKVPool,
                                    req_to_token_pool: ReqToTokenPool, eager_backend: Any
                                    ) -> DraftExtendGraphRunner | None:
    """The STANDALONE draft model's extend runner the flags ask for, warmed up, or ``None`` (its extends run
    eagerly)."""

    def make(use_graphs: bool, compile_max_bs: int) -> DraftExtendGraphRunner:
        return DraftExtendGraphRunner(args, model, kv_pool, req_to_token_pool, eager_backend, use_graphs,
                                      compile_max_bs, STANDALONE_EXTEND_ROWS)

    return build_step_runner(args, kv_pool.device, DraftExtendGraphRunner.kind, make)


def build_eagle_extend_graph_runner(args: ServerArgs, head: EagleHead, kv_pool: MHATokenToKVPool,
                                    req_to_token_pool: ReqToTokenPool, eager_backend: Any, num_steps: int
                                    ) -> EagleExtendGraphRunner | None:
    """The head's extend runner (``num_steps + 1`` rows per request) the flags ask for, warmed up, or ``None``."""

    def make(use_graphs: bool, compile_max_bs: int) -> EagleExtendGraphRunner:
        return EagleExtendGraphRunner(args, head, kv_pool, req_to_token_pool, eager_backend, use_graphs,
                                      compile_max_bs, num_steps + 1)

    return build_step_runner(args, kv_pool.device, EagleExtendGraphRunner.kind, make)
