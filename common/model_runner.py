"""``ModelRunner``: owns the model, the memory pools and the sampler; runs one ``ModelWorkerBatch``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from common.config import ServerArgs
from common.forward_batch import ForwardBatch, ForwardMode
from common.mem.allocator import TokenToKVPoolAllocator
from common.mem.kv_pool import MHATokenToKVPool
from common.mem.req_to_token_pool import ReqToTokenPool
from common.model.config import ModelConfig
from common.model.loader import load_model
from common.sampling.sampler import SampleOutput, Sampler, SamplingBatchInfo
from common.schedule_batch import ModelWorkerBatch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BatchResult:
    next_token_ids: list[int]
    sample: SampleOutput


def kv_pool_pages(args: ServerArgs, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Number of KV pages from ``--max-total-tokens`` or ``--mem-fraction-static`` of available memory."""
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    else:
        per_token = MHATokenToKVPool.bytes_per_token(
            model_config.num_kv_heads, model_config.head_dim, model_config.num_layers, dtype
        )
        tokens = int(psutil.virtual_memory().available * args.mem_fraction_static) // per_token
        tokens = min(tokens, 4 * 1024 * 1024)
    return max(1, tokens // args.page_size)


class ModelRunner:
    def __init__(self, args: ServerArgs, model_path: str) -> None:
        self.args = args
        self.dtype = DTYPES[args.dtype]
        self.device = torch.device(args.device)
        torch.manual_seed(args.seed)
        self.model, self.model_config = load_model(model_path, dtype=self.dtype, device=self.device)
        cfg = self.model_config
        num_pages = kv_pool_pages(args, cfg, self.dtype)
        self.kv_pool = MHATokenToKVPool(
            num_pages, args.page_size, self.dtype, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, self.device
        )
        self.allocator = TokenToKVPoolAllocator(num_pages, args.page_size, self.device)
        self.max_context_len = cfg.context_len
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests + 1, cfg.context_len + 8, self.device)
        self.attn_backend = self.model.make_attn_backend(args.resolved_attention_backend)
        self.sampler = Sampler(seed=args.seed)
        logger.info(
            "KV cache: %d pages x %d tokens (%.1f MiB), max running requests %d",
            num_pages, args.page_size,
            num_pages * args.page_size * MHATokenToKVPool.bytes_per_token(
                cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, self.dtype) / 2**20,
            args.max_running_requests,
        )

    @property
    def max_total_num_tokens(self) -> int:
        return self.allocator.size

    def _forward_batch(self, b: ModelWorkerBatch) -> ForwardBatch:
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        if b.forward_mode.is_decode():
            positions = t([s - 1 for s in b.seq_lens])
        else:
            positions = torch.cat([torch.arange(p, s, dtype=torch.int64) for p, s in zip(b.prefix_lens, b.seq_lens,
                                                                                         strict=True)])
        return ForwardBatch(
            forward_mode=b.forward_mode,
            batch_size=len(b.reqs),
            input_ids=t(b.input_ids),
            positions=positions.to(self.device),
            out_cache_loc=b.out_cache_loc.to(self.device),
            req_pool_indices=t(b.req_pool_indices),
            seq_lens=t(b.seq_lens),
            extend_lens=t(b.extend_lens),
            prefix_lens=t(b.prefix_lens),
            req_to_token=self.req_to_token_pool.req_to_token,
            seq_lens_cpu=b.seq_lens,
            extend_lens_cpu=b.extend_lens,
            prefix_lens_cpu=b.prefix_lens,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )

    @torch.inference_mode()
    def forward_and_sample(self, b: ModelWorkerBatch) -> BatchResult:
        fb = self._forward_batch(b)
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model.forward(fb)
        if fb.forward_mode != ForwardMode.DECODE:
            hidden = hidden[fb.last_token_indices()]
        logits = self.model.compute_logits(hidden)
        info = SamplingBatchInfo.from_reqs(b.reqs, self.model_config.vocab_size, self.device)
        sample = self.sampler(logits, info)
        return BatchResult(sample.next_token_ids.tolist(), sample)
