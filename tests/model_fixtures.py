"""Reusable model fixtures: tiny generated models (cached per test session), HF reference logits, and a
minimal paged-KV harness that builds ``ForwardBatch`` by hand (no scheduler, no real allocator)."""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.model.llama import LlamaForCausalLM
from common.engine.model.loader import load_model


@functools.cache
def _session_dir() -> Path:
    root = Path(tempfile.mkdtemp(prefix="pdcluster-test-models-"))
    atexit.register(shutil.rmtree, root, True)
    return root


@functools.cache
def make_tiny_model(arch: str = "llama", seed: int = 0) -> Path:
    """A tiny generated model folder for ``arch`` (llama, qwen2, qwen3, mistral), built once per process."""
    from common.model_gen import make_model  # imports transformers: not on the path of spawned TP ranks

    return make_model(arch, "tiny", _session_dir() / f"{arch}-tiny-s{seed}", seed=seed)


@functools.cache
def make_copy_model(arch: str = "llama") -> Path:
    """``make_tiny_model(arch)`` with zeroed attention outputs: greedy decoding cycles and repeats spans of its
    prompt (``common.model_gen.copy_model``)."""
    from common.model_gen.copy_model import make_copy_model as write

    return write(make_tiny_model(arch), _session_dir() / f"{arch}-tiny-copy")


@functools.cache
def load_tiny_model(arch: str = "llama", seed: int = 0) -> LlamaForCausalLM:
    """Our fp32 model for ``make_tiny_model(arch, seed)`` (shared: treat as read-only), its GEMM weights packed for
    oneDNN as ``ModelRunner`` packs them on CPU (``pack_cpu_weights``)."""
    model = load_model(make_tiny_model(arch, seed))[0]
    model.pack_cpu_weights()
    return model


@functools.cache
def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    """HF's fp32 logits [len(token_ids), vocab] for one full sequence (no cache, no padding): the oracle."""
    with torch.inference_mode():
        return hf_model(path)(torch.tensor([token_ids])).logits[0].float()


@dataclass
class _Req:
    row: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the pool, in order
    pages: list[int] = field(default_factory=list)


class PagedHarness:
    """Owns a KV pool and a req_to_token table; pages are handed out in a shuffled order so a request's slots are
    scattered over the pool. Slot of a request's token at position p: pages[p // page_size] * page_size + p % page_size
    (the paged allocator's layout), unless ``scatter_slots``.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        page_size: int,
        num_pages: int = 256,
        max_reqs: int = 16,
        seed: int = 0,
        kv_dtype: torch.dtype = torch.float32,
        scatter_slots: bool = False,
    ) -> None:
        """``scatter_slots``: hand out single slots in shuffled order, ignoring page alignment (the attention
        backend must then fall back from page gathers to slot gathers)."""
        cfg = model.config
        self.model = model
        self.page_size = page_size
        self.pool = MHATokenToKVPool(
            num_pages, page_size, kv_dtype, model.num_local_kv_heads, cfg.head_dim, cfg.num_layers
        )
        self.req_to_token = torch.zeros(max_reqs, cfg.context_len, dtype=torch.int64)
        self.free_pages = list(range(1, num_pages + 1))
        random.Random(seed).shuffle(self.free_pages)
        self.free_slots = list(range(page_size, (num_pages + 1) * page_size)) if scatter_slots else None
        if self.free_slots is not None:
            random.Random(seed).shuffle(self.free_slots)
        self.last_batch: ForwardBatch | None = None
        self.reqs: dict[str, _Req] = {}
        self.backend = model.make_attn_backend()

    def add(self, rid: str, share_prefix_of: str | None = None, prefix_len: int = 0) -> None:
        """New request; optionally its first ``prefix_len`` tokens (a page multiple) reuse another's KV pages."""
        req = _Req(row=len(self.reqs))
        if share_prefix_of is not None:
            assert prefix_len % self.page_size == 0
            src = self.reqs[share_prefix_of]
            req.tokens = src.tokens[:prefix_len]
            req.pages = src.pages[: prefix_len // self.page_size]
            self.req_to_token[req.row, :prefix_len] = self.req_to_token[src.row, :prefix_len]
        self.reqs[rid] = req

    def forward(
        self, batch: list[tuple[str, list[int]]], mode: ForwardMode | None = None,
        positions: list[int] | None = None, custom_mask: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Run one forward over ``(request id, new tokens)`` pairs; returns each request's logits [n_new, vocab].
        ``positions``/``custom_mask``: a draft tree's verify (``ForwardBatch.custom_mask``); the new tokens still
        take the slots of consecutive positions."""
        ids, pos, locs, ext, pre, seq = [], [], [], [], [], []
        for rid, new in batch:
            req = self.reqs[rid]
            start = len(req.tokens)
            for i, tok in enumerate(new):
                p = start + i
                if self.free_slots is not None:
                    slot = self.free_slots.pop()
                else:
                    if p // self.page_size >= len(req.pages):
                        req.pages.append(self.free_pages.pop())
                    slot = req.pages[p // self.page_size] * self.page_size + p % self.page_size
                self.req_to_token[req.row, p] = slot
                ids.append(tok)
                pos.append(p)
                locs.append(slot)
            req.tokens += new
            ext.append(len(new))
            pre.append(start)
            seq.append(start + len(new))
        if mode is None:
            mode = ForwardMode.DECODE if all(n == 1 for n in ext) else ForwardMode.EXTEND
        i64 = torch.int64
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(batch),
            input_ids=torch.tensor(ids, dtype=i64),
            positions=torch.tensor(pos if positions is None else positions, dtype=i64),
            out_cache_loc=torch.tensor(locs, dtype=i64),
            req_pool_indices=torch.tensor([self.reqs[rid].row for rid, _ in batch], dtype=i64),
            seq_lens=torch.tensor(seq, dtype=i64),
            extend_lens=torch.tensor(ext, dtype=i64),
            prefix_lens=torch.tensor(pre, dtype=i64),
            req_to_token=self.req_to_token,
            seq_lens_cpu=seq,
            extend_lens_cpu=ext,
            prefix_lens_cpu=pre,
            kv_pool=self.pool,
            attn_backend=self.backend,
            custom_mask=custom_mask,
        )
        self.last_batch = fb
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(fb))
        return list(logits.split(ext))
