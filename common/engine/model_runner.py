"""``ModelRunner``: owns the model, the memory pools and the sampler; runs one ``ModelWorkerBatch``.

Host/device split of one step: the scheduler's state (allocator, prefix cache, the authoritative ``req_to_token``)
is on the host. ``_forward_batch`` packs the step's int inputs (input_ids, positions, out_cache_loc, the per-request
lengths, the ``req_to_token`` entries written since the last step) into ONE host-to-device copy and scatters the
table entries into the device mirror; the sampler's per-step tensors take one more copy when a row samples. The
results come back through one device-to-host read (``SampleOutput.to_host``). On CPU no copy happens at all.

Overlap schedule: the runner runs on the forward thread, one batch at a time in launch order. A batch's input ids
may hold placeholders of tokens the previous batch samples; they are resolved from ``future_tokens`` before the
forward, and each batch stores its sampled tokens there (``common.engine.overlap``). Everything read from the requests
(sampling parameters, draw steps) was copied into the ``ModelWorkerBatch`` on the scheduler thread.

Tensor parallelism: under a ``TPGroup`` of size > 1 the model is this rank's shard, the KV pool holds this rank's
KV heads only, and the pool's page count is the MIN over the group (page indices mean the same slots on every
rank). Every rank gets the same logits and samples them the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from common.config import ServerArgs
from common.engine.device import MAX_KV_TOKENS, kv_cache_bytes, rank_device, ship
from common.engine.distributed import TPGroup
from common.engine.forward_batch import ForwardBatch
from common.engine.graph_runner import DecodeGraphRunner, build_graph_runner
from common.engine.mem.allocator import TokenToKVPoolAllocator
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.mem.req_to_token_pool import ReqToTokenPool
from common.engine.model.config import ModelConfig
from common.engine.model.loader import load_model
from common.engine.overlap import FutureTokenMap
from common.engine.sampling.sample_output import HostSample, HostSampleCopy, SampleOutput
from common.engine.sampling.sampler import Sampler, SamplingBatchInfo
from common.engine.schedule_batch import ModelWorkerBatch
from common.engine.spec.drafter import DraftKV, SpecHook
from common.engine.verify_graph_runner import VerifyGraphRunner, build_verify_graph_runner

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BatchResult:
    next_token_ids: list[int]
    logprobs: list[float] | None  # per row; None when no row asked
    top_logprobs: list[list[tuple[int, float]]] | None
    sample: SampleOutput  # the device tensors behind the lists


class PendingBatchResult:
    """A launched batch: on CUDA its sampled values are still on their way to pinned host memory (the forward thread
    is already free for the next batch); elsewhere they were read at once. ``wait`` returns (and keeps) the
    ``BatchResult``; when it returns, every kernel of the batch has completed (KV writes included)."""

    def __init__(self, sample: SampleOutput, host: HostSample | HostSampleCopy) -> None:
        self.sample = sample
        self._host = host
        self._result: BatchResult | None = None

    def wait(self) -> BatchResult:
        if self._result is None:
            host = self._host.wait() if isinstance(self._host, HostSampleCopy) else self._host
            self._result = BatchResult(host.next_token_ids, host.logprobs, host.top_logprobs, self.sample)
        return self._result


def kv_pool_pages(
    args: ServerArgs,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device = torch.device("cpu"),
    num_kv_heads: int | None = None,
) -> int:
    """Number of KV pages from ``--max-total-tokens`` or ``--mem-fraction-static`` (see ``kv_cache_bytes``), for a
    pool of ``num_kv_heads`` heads (default: all of the model's; a TP rank passes its own)."""
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    else:
        heads = model_config.num_kv_heads if num_kv_heads is None else num_kv_heads
        per_token = MHATokenToKVPool.bytes_per_token(heads, model_config.head_dim, model_config.num_layers, dtype)
        # NOTE: on CPU the TP ranks of one host share its RAM: together they take the fraction a tp 1 rank takes
        # (on CUDA each rank owns its GPU).
        sharing = len(args.tp_ranks_here) if device.type == "cpu" else 1
        tokens = min(kv_cache_bytes(args, device) // sharing // per_token, MAX_KV_TOKENS)
    return max(1, tokens // args.page_size)


class ModelRunner:
    def __init__(self, args: ServerArgs, model_path: str, dp_rank: int = 0, tp: TPGroup | None = None) -> None:
        """``tp``: the rank's TP group (None: a group of one). Every rank of a group must construct its runner:
        the pool size is agreed over the group's CPU process group."""
        self.args = args
        self.tp = tp or TPGroup(dp_rank=dp_rank)
        self.dtype = DTYPES[args.dtype]
        self.device = rank_device(args, dp_rank, self.tp.tp_rank)
        torch.manual_seed(args.seed)
        self.model, self.model_config = load_model(model_path, dtype=self.dtype, device=self.device, tp=self.tp,
                                                   load_format=args.load_format)
        if self.device.type == "cpu" and not args.enable_torch_compile:
            self.model.pack_cpu_weights()  # compiled steps trace the plain weights
        cfg = self.model_config
        kv_heads = self.model.num_local_kv_heads
        num_pages = kv_pool_pages(args, cfg, self.dtype, self.device, kv_heads)
        if self.tp.tp_size > 1:
            num_pages = int(self.tp.all_reduce_min(torch.tensor([num_pages], dtype=torch.int64)).item())
        self.kv_pool = MHATokenToKVPool(
            num_pages, args.page_size, self.dtype, kv_heads, cfg.head_dim, cfg.num_layers, self.device
        )
        self.allocator = TokenToKVPoolAllocator(num_pages, args.page_size)  # host: scheduler bookkeeping
        self.max_context_len = cfg.context_len
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests + 1, cfg.context_len + 8, self.device)
        self.attn_backend = self.model.make_attn_backend(args.resolved_attention_backend)
        if args.resolved_attention_backend == "triton" and not args.enable_torch_compile:
            # Triton for the element-wise ops too; compiled steps leave their fusion to inductor.
            self.model.use_triton_kernels()
        self.sampler = Sampler(seed=args.seed)
        self.future_tokens = FutureTokenMap(self.req_to_token_pool.size, self.device)
        logger.info(
            "KV cache on %s: %d pages x %d tokens (%.1f MiB), max running requests %d",
            self.device, num_pages, args.page_size,
            num_pages * args.page_size * MHATokenToKVPool.bytes_per_token(
                kv_heads, cfg.head_dim, cfg.num_layers, self.dtype) / 2**20,
            args.max_running_requests,
        )
        # A drafter told of every forward's features and sampled tokens (``set_spec_hook``): EAGLE's head, a P/D
        # node's STANDALONE draft (it extends over prefill chunks).
        self.spec_hook: SpecHook | None = None
        self.draft_kv: DraftKV | None = None  # a drafter's KV under this pool's slots (P/D sends it with the pool's)
        # Last: capturing/compiling runs the model over the pools built above. With EAGLE the decode graphs wait for
        # the head's capture set (``build_spec_graph_runners``).
        self.graph_runner: DecodeGraphRunner | None = None
        self.verify_graph_runner: VerifyGraphRunner | None = None
        # A STANDALONE draft model's decode-time extends (``spec.draft_extend_graph_runner``; set by its drafter).
        self.draft_extend_graph_runner: VerifyGraphRunner | None = None
        if args.speculative_algorithm not in ("EAGLE", "EAGLE3"):
            self.graph_runner = build_graph_runner(args, self.model, self.kv_pool, self.req_to_token_pool,
                                                   self.attn_backend)

    @property
    def max_total_num_tokens(self) -> int:
        return self.allocator.size

    def _forward_batch(self, b: ModelWorkerBatch) -> ForwardBatch:
        i64 = torch.int64
        tree = b.spec_info.tree_inputs() if b.spec_info is not None else None
        if b.forward_mode.is_decode():
            positions = torch.tensor([s - 1 for s in b.seq_lens], dtype=i64)
        elif tree is not None:
            positions = torch.tensor(tree[0], dtype=i64)
        else:
            positions = torch.cat([torch.arange(p, s, dtype=i64) for p, s in zip(b.prefix_lens, b.seq_lens,
                                                                                 strict=True)])
        bs = len(b.reqs)
        slots = b.future_slots if b.future_slots is not None else []
        per_req = torch.tensor(b.req_pool_indices + b.seq_lens + b.extend_lens + b.prefix_lens + slots, dtype=i64)
        parts = [torch.tensor(b.input_ids, dtype=i64), positions, b.out_cache_loc, per_req]
        pool = self.req_to_token_pool
        updates = pool.take_updates()  # None on CPU: the table there is the host table itself
        if updates is not None:
            parts += updates
        dev = ship(parts, self.device)
        if updates is not None:
            pool.device_req_to_token.view(-1).index_put_((dev[4],), dev[5])
        rpi, seq_lens, extend_lens, prefix_lens, *future_slots = dev[3].split(bs)
        input_ids = self.future_tokens.resolve(dev[0]) if b.has_placeholders else dev[0]
        return ForwardBatch(
            forward_mode=b.forward_mode,
            batch_size=bs,
            future_slots=future_slots[0] if future_slots else None,
            input_ids=input_ids,
            positions=dev[1],
            out_cache_loc=dev[2],
            req_pool_indices=rpi,
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            prefix_lens=prefix_lens,
            req_to_token=pool.device_req_to_token,
            seq_lens_cpu=b.seq_lens,
            extend_lens_cpu=b.extend_lens,
            prefix_lens_cpu=b.prefix_lens,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            spec_info=b.spec_info,
            custom_mask=None if tree is None else tree[1].to(self.device),
        )

    def set_spec_hook(self, hook: SpecHook) -> None:
        """From now on every forward ends with ``hook.after_forward`` (a step runner serves it only if it captures
        ``hook.capture``: ``build_spec_graph_runners``)."""
        self.spec_hook = hook

    def build_spec_graph_runners(self, num_rows: int) -> None:
        """Speculation's step runners (after the drafter set its hook, if any): verify forwards of ``num_rows``
        rows per request, and with a hook the decode steps too, both capturing what the hook reads."""
        capture = self.spec_hook.capture if self.spec_hook is not None else frozenset()
        args = self.args
        if self.graph_runner is None:
            self.graph_runner = build_graph_runner(args, self.model, self.kv_pool, self.req_to_token_pool,
                                                   self.attn_backend, capture)
        self.verify_graph_runner = build_verify_graph_runner(args, self.model, self.kv_pool, self.req_to_token_pool,
                                                             self.attn_backend, num_rows, capture)

    def _step_runner(self, fb: ForwardBatch) -> DecodeGraphRunner | VerifyGraphRunner | None:
        capture = self.spec_hook.capture if self.spec_hook is not None else frozenset()
        for runner in (self.graph_runner, self.verify_graph_runner, self.draft_extend_graph_runner):
            if runner is not None and runner.capture == capture and runner.can_run(fb):
                return runner
        return None

    def forward_and_sample(self, b: ModelWorkerBatch) -> BatchResult:
        return self.launch(b).wait()

    @torch.inference_mode()
    def launch(self, b: ModelWorkerBatch) -> PendingBatchResult:
        """Enqueue the batch's forward and sampling; on CUDA returns before they run (``PendingBatchResult``)."""
        if self.device.type == "cuda":
            # NOTE: the current device is per thread (the prefill node forwards on a worker thread); kernels that
            # launch on the current device (Triton) must see this rank's GPU.
            with torch.cuda.device(self.device):
                sample = self._forward_and_sample(b)
                return PendingBatchResult(sample, sample.start_to_host())
        sample = self._forward_and_sample(b)
        return PendingBatchResult(sample, sample.to_host())

    def _forward_and_sample(self, b: ModelWorkerBatch) -> SampleOutput:
        fb = self._forward_batch(b)
        hook = self.spec_hook
        runner = self._step_runner(fb)
        if runner is not None:
            hidden, features = runner.forward_features(fb)
        else:
            self.attn_backend.init_forward_metadata(fb)
            if hook is not None and hook.capture:
                hidden, features = self.model.forward_capture(fb, hook.capture)
            else:
                hidden = features = self.model.forward(fb)
        if not fb.forward_mode.logits_at_every_token():
            hidden = hidden[fb.last_token_indices()]
        logits = self.model.compute_logits(hidden)
        info = b.sampling_info or SamplingBatchInfo.from_reqs(b.reqs, self.model_config.vocab_size, self.device)
        sample = self.sampler(logits, info)
        if hook is not None:
            hook.after_forward(b, fb, features, sample.next_token_ids)
        if fb.future_slots is not None:
            self.future_tokens.store(fb.future_slots, sample.next_token_ids)
        return sample
