"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, Mistral) over the paged KV pool.

Feature flags come from ``ModelConfig``: qkv_bias / o_bias (Qwen2), qk_norm (Qwen3), tie_word_embeddings,
sliding_window (Mistral, in the attention backend), RoPE scaling (in ``RotaryEmbedding``).
Parameter names are HF's except the fused ``qkv_proj`` (rows: q | k | v) and ``gate_up_proj`` (rows: gate | up).

Tensor parallelism (``common.engine.model.parallel``): each rank holds its query heads, KV heads and MLP rows (qkv_proj:
its q heads | its kv heads | its kv heads), o_proj and down_proj reduce over the group, the embedding is replicated
and the LM head is vocab-parallel (logits gathered, then sliced back to the vocab). Every rank ends a forward with
the same hidden states and the same logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.distributed import TPGroup
from common.engine.forward_batch import ForwardBatch
from common.engine.model.attention import TorchAttentionBackend
from common.engine.model.config import ModelConfig
from common.engine.model.layers import (
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    RowParallelLinear,
    fused_layers,
    onednn_linear,
    onednn_pack,
)
from common.engine.model.parallel import ShardLayout
from common.engine.model.rope import RotaryEmbedding, apply_rotary_signed

if TYPE_CHECKING:
    from common.engine.model.triton_backend import TritonAttentionBackend


class LlamaAttention(nn.Module):
    """This rank's heads only (``shard``); o_proj reduces over the group."""

    def __init__(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device, shard: ShardLayout,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.qkv_bias, dtype, device)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, cfg.o_bias, dtype, device, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.fused_rotary = False

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """``sin`` is the signed table of ``RotaryEmbedding.cos_signed_sin``."""
        t, nq, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = apply_rotary_signed(self.q_norm(qkv[:, : nq * d].view(t, nq, d)), cos, sin)
            k = apply_rotary_signed(self.k_norm(qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d)), cos, sin)
        elif self.fused_rotary:  # in place on the fresh qkv rows, one launch
            qk = fused_layers().rotary_signed_(qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d), cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
        else:  # one rotary over the q and k heads together
            qk = apply_rotary_signed(qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d), cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
        return self.o_proj(fb.attn_backend.forward(q, k, v, self.layer_id, fb))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device, shard: ShardLayout,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, dtype, device, shard, tp)
        self.mlp = GatedMLP(cfg.hidden_size, shard.intermediate, dtype, device, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried beside each sublayer's output and summed by the next pre-norm
        (``RMSNorm.add_forward``): the layer returns (mlp output, residual); their sum is the layer's output.
        ``residual`` None: ``h`` is the embedding, the stream's start."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        x, residual = self.post_attention_layernorm.add_forward(self.self_attn(x, cos, sin, fb), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, shard: ShardLayout, tp: TPGroup
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)  # replicated
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, dtype, device, shard, tp) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim).to(device)

    def forward(self, fb: ForwardBatch, capture: frozenset[int] = frozenset(), aux: list[torch.Tensor] | None = None
                ) -> torch.Tensor:
        """``capture``: residual streams to append to ``aux``, by the index of the layer they enter (``num_layers``:
        the last layer's output, before the final norm), in layer order."""
        h = self.embed_tokens(fb.input_ids)
        cos, sin = self.rotary.cos_signed_sin(fb.positions, h.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            if i in capture and aux is not None:  # NOTE: a copy: fused norms add into the stream in place
                aux.append(h.clone() if residual is None else h + residual)
            h, residual = layer(h, residual, cos, sin, fb)
        if len(self.layers) in capture and aux is not None:
            aux.append(h.clone() if residual is None else h + residual)
        return self.norm(h) if residual is None else self.norm.add_forward(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tp: TPGroup | None = None,
    ) -> None:
        """``tp``: this rank's group (None: the whole model on one rank). Raises ``ConfigError`` when the group's
        size cannot split the model."""
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.device = device
        self.tp = tp or TPGroup()
        self.shard = ShardLayout.for_config(cfg, self.tp.tp_rank, self.tp.tp_size)
        self.model = LlamaModel(cfg, dtype, device, self.shard, self.tp)
        # One rank with tied embeddings reads the LM head from the embedding itself; a TP shard of it is a copy
        # (the loader fills it from the embedding's rows).
        tied_whole = cfg.tie_word_embeddings and self.tp.tp_size == 1
        self.lm_head = (
            None if tied_whole else Linear(cfg.hidden_size, self.shard.vocab_per_rank, False, dtype, device)
        )
        self.tied_head_packed: torch.Tensor | None = None  # the embedding in oneDNN's layout (pack_cpu_weights)

    def make_attn_backend(self, backend: str = "torch") -> TorchAttentionBackend | TritonAttentionBackend:
        """``backend``: ``torch`` (padded SDPA over gathered pages) or ``triton`` (paged kernels, no gather)."""
        cfg = self.config
        if backend == "triton":
            from common.engine.model.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend(
                self.shard.num_heads, self.shard.num_kv_heads, cfg.head_dim, cfg.sliding_window, self.device
            )
        if backend != "torch":
            raise ValueError(f"unknown attention backend {backend!r} (torch or triton)")
        return TorchAttentionBackend(self.shard.num_heads, self.shard.num_kv_heads, cfg.head_dim, cfg.sliding_window)

    def use_triton_kernels(self, on: bool = True) -> None:
        """Fused Triton kernels for the decoder's RMSNorms (with the residual add), rotary and SiLU·mul instead of
        torch's op sequences (``common.engine.kernels.fused_layers``): the CUDA path, where each small op is a
        kernel launch. Models with per-head q/k norms (Qwen3) keep torch's rotary."""
        m = self.model
        m.norm.fused = on
        for layer in m.layers:
            layer.input_layernorm.fused = layer.post_attention_layernorm.fused = on
            layer.mlp.fused = on
            layer.self_attn.fused_rotary = on and layer.self_attn.q_norm is None

    def pack_cpu_weights(self) -> int:
        """CPU fp32 / bf16: every GEMM weight (the LM head included) into oneDNN's layout (``Linear.pack_for_cpu``),
        for the eager forward only (a compiled step traces ``F.linear``). A tied LM head gets a packed copy of the
        embedding (the lookup keeps the original). Returns how many weights were packed: 0 where oneDNN is not
        available for the dtype, the forward unchanged."""
        packed = sum(m.pack_for_cpu() for m in self.modules() if isinstance(m, Linear))
        if self.lm_head is None and self.tied_head_packed is None:
            self.tied_head_packed = onednn_pack(self.model.embed_tokens.weight)
        return packed + (self.tied_head_packed is not None)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank's pool holds."""
        return self.shard.num_kv_heads

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]. Writes every layer's K/V of the new tokens to
        ``fb.kv_pool`` at ``fb.out_cache_loc``. Builds ``fb.attn_metadata`` first if the runner has not."""
        if fb.attn_metadata is None:
            fb.attn_backend.init_forward_metadata(fb)
        return self.model(fb)

    def forward_capture(self, fb: ForwardBatch, capture: frozenset[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` plus the residual streams entering the layers in ``capture`` (``num_layers``: the last layer's
        output), concatenated in layer order: [num_tokens, len(capture) * hidden] (EAGLE-3's draft input). A plain
        ``forward`` captures nothing."""
        if fb.attn_metadata is None:
            fb.attn_backend.init_forward_metadata(fb)
        aux: list[torch.Tensor] = []
        hidden = self.model(fb, capture, aux)
        return hidden, torch.cat(aux, dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, vocab] for hidden states [n, hidden] (select the rows you need first); with TP the
        full vocab, the same on every rank."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif self.tied_head_packed is not None:
            logits = onednn_linear(hidden, self.tied_head_packed, None).float()
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        if self.tp.tp_size == 1:
            return logits
        logits = self.tp.all_gather(logits, dim=-1)
        vocab = self.config.vocab_size
        return logits if logits.shape[-1] == vocab else logits[:, :vocab].contiguous()
