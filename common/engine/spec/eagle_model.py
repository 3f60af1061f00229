"""The EAGLE draft head: one Llama decoder layer over [token embedding; a feature of the previous position].

Row layout of one head forward (the target's ``ForwardBatch`` layout, the head's own one-layer KV pool)::

    row at position p:  input_ids[row] = x_{p+1}  (the token AFTER p)   hidden[row] = f_p (the feature AT p)
    output row:          the predicted feature f_{p+1} and the logits of x_{p+2}

EAGLE-1/2 (``LlamaForCausalLM`` checkpoints, yuhuili/EAGLE-*):
    f_p  = the target's final hidden state (after its last norm: what its LM head reads)
    out  = layer(fc([embed(x_{p+1}); f_p]))      the layer has no input norm; no final norm
    logits = target.lm_head(out), next f = out

EAGLE-3 (``LlamaForCausalLMEagle3`` checkpoints, yuhuili/EAGLE3-*):
    f_p  = fc([target residual streams entering 3 of its layers]) (low, mid, high), or the head's own f from the
           previous draft step (already ``hidden_size`` wide: no fc)
    attn input = [input_layernorm(embed(x_{p+1})); hidden_norm(f_p)]   (2 * hidden_size wide), residual = f_p
    logits = lm_head(norm(out)) over the draft vocab (target id = d + d2t[d]), next f = out before the norm

The embedding is always the target's (the checkpoints' copy, when present, is not read); EAGLE-1 also shares the
target's LM head. Under tensor parallelism the head's layer is sharded over the target's ``TPGroup`` as a target
layer is (``ShardLayout`` of the head's config: its heads, KV heads and MLP rows; o_proj and down_proj reduce), so
rank r's head KV holds the KV heads rank r's target pool holds and travels with it in P/D; fc, the norms and
EAGLE3's own LM head are replicated. Every rank ends a head forward with the same features and logits, so every
rank drafts the same tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.distributed import TPGroup
from common.engine.forward_batch import ForwardBatch
from common.engine.model.attention import TorchAttentionBackend
from common.engine.model.config import ModelConfig, RopeParams
from common.engine.model.hf_config import _rope_parameters
from common.engine.model.layers import GatedMLP, Linear, RMSNorm
from common.engine.model.llama import LlamaAttention, LlamaForCausalLM
from common.engine.model.parallel import ShardLayout
from common.engine.model.rope import RotaryEmbedding
from common.errors import ModelLoadError

if TYPE_CHECKING:
    from common.engine.model.triton_backend import TritonAttentionBackend

EAGLE, EAGLE3 = "EAGLE", "EAGLE3"


@dataclass(frozen=True)
class EagleConfig:
    path: Path
    algorithm: str  # EAGLE or EAGLE3
    layer: ModelConfig  # the decoder layer's shapes (num_layers 1), eps and RoPE
    fc_in: int  # EAGLE: 2 * hidden; EAGLE3: 3 * the target's hidden
    fc_bias: bool
    draft_vocab_size: int  # rows of the logits the head drafts from (EAGLE: the target's vocab)
    own_lm_head: bool  # EAGLE3 with lm_head.weight in the checkpoint; else the target's head
    capture: frozenset[int]  # EAGLE3: target layers whose input residual stream is the draft input (num_layers:
    #                          the last layer's output)

    @property
    def target_feature_size(self) -> int:
        """Width of the target's feature the head reads: EAGLE its hidden; EAGLE3 three residual streams."""
        return self.fc_in if self.algorithm == EAGLE3 else self.layer.hidden_size

    @classmethod
    def from_path(cls, path: str | Path, algorithm: str, target: ModelConfig, weight_names: set[str]) -> EagleConfig:
        """Read the head's config.json; ``weight_names`` (the checkpoint's tensor names) decide the optional parts.
        Raises ``ModelLoadError`` naming the file and what to fix."""
        path = Path(path)
        file = path / "config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{file}: cannot be read ({e}); pass the draft head's folder") from e
        if algorithm not in (EAGLE, EAGLE3):
            raise ModelLoadError(f"unknown EAGLE algorithm {algorithm!r} (EAGLE or EAGLE3)")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layer = replace(
                target,
                path=path,
                architecture=(raw.get("architectures") or ["?"])[0],
                hidden_size=hidden,
                num_layers=1,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", target.rms_norm_eps)),
                rope=_rope(raw, file, target.rope),
                qkv_bias=bool(raw.get("attention_bias", False)),
                o_bias=bool(raw.get("attention_bias", False)),
                qk_norm=False,
                sliding_window=None,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{file}: missing or malformed field ({e})") from e
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise ModelLoadError(f"{file}: num_hidden_layers {raw['num_hidden_layers']} (an EAGLE head has 1 layer)")
        if int(raw.get("vocab_size", target.vocab_size)) != target.vocab_size:
            raise ModelLoadError(
                f"{file}: vocab_size {raw['vocab_size']} differs from the target's {target.vocab_size}: "
                "the head belongs to another model"
            )
        if algorithm == EAGLE:
            if hidden != target.hidden_size:
                raise ModelLoadError(f"{file}: hidden_size {hidden} != the target's {target.hidden_size}")
            return cls(path, algorithm, layer, 2 * hidden, "fc.bias" in weight_names, target.vocab_size, False,
                       frozenset())
        target_hidden = int(raw.get("target_hidden_size") or target.hidden_size)
        if target_hidden != target.hidden_size:
            raise ModelLoadError(f"{file}: target_hidden_size {target_hidden} != the target's {target.hidden_size}")
        own_head = "lm_head.weight" in weight_names and not layer.tie_word_embeddings
        draft_vocab = int(raw.get("draft_vocab_size") or target.vocab_size) if own_head else target.vocab_size
        return cls(path, algorithm, layer, 3 * target_hidden, bool(raw.get("bias", False)), draft_vocab, own_head,
                   _capture(raw, file, target.num_layers))


def _rope(raw: dict, file: Path, target: RopeParams) -> RopeParams:
    """The head's RoPE; the target's when its config names none (the head is trained on the target's positions)."""
    if not any(k in raw for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        return target
    rp = _rope_parameters(raw, file)
    if rp is None:
        raise ModelLoadError(f"{file}: this RoPE form is not supported for a draft head")
    return RopeParams(
        theta=float(rp["rope_theta"]),
        rope_type=rp.get("rope_type", "default"),
        factor=float(rp.get("factor", 1.0)),
        low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            rp.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def _capture(raw: dict, file: Path, num_layers: int) -> frozenset[int]:
    """Target layers whose input stream EAGLE3 reads: ``eagle_config.eagle_aux_hidden_state_layer_ids`` name the
    layers whose OUTPUT is read (so +1); without it, SGLang's default (2, L // 2, L - 3)."""
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    capture = [2, num_layers // 2, num_layers - 3] if ids is None else [int(i) + 1 for i in ids]
    if len(set(capture)) != 3 or not all(0 <= i <= num_layers for i in capture):
        raise ModelLoadError(
            f"{file}: EAGLE3 reads 3 distinct target layers in 0..{num_layers}, got inputs of {capture} "
            f"(set eagle_config.eagle_aux_hidden_state_layer_ids to 3 layer ids in -1..{num_layers - 1})"
        )
    return frozenset(capture)


class EagleDecoderLayer(nn.Module):
    """One Llama layer; EAGLE: no input norm; EAGLE3: attention over [norm(embed); norm(hidden)]."""

    def __init__(self, cfg: ModelConfig, eagle3: bool, dtype: torch.dtype, device: torch.device, shard: ShardLayout,
                 tp: TPGroup) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = LlamaAttention(cfg, 0, dtype, device, shard, tp)
        if eagle3:
            q, kv = shard.num_heads * cfg.head_dim, shard.num_kv_heads * cfg.head_dim
            self.self_attn.qkv_proj = Linear(2 * h, q + 2 * kv, cfg.qkv_bias, dtype, device)
        self.mlp = GatedMLP(h, shard.intermediate, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device) if eagle3 else None
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device) if eagle3 else None

    def forward(
        self, x: torch.Tensor, embeds: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual): their sum is the layer's output. ``embeds`` only for EAGLE3."""
        if self.input_layernorm is not None and self.hidden_norm is not None and embeds is not None:
            attn_in = torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1)
        else:
            attn_in = x
        y, residual = self.post_attention_layernorm.add_forward(self.self_attn(attn_in, cos, sin, fb), x)
        return self.mlp(y), residual


class EagleHead(nn.Module):
    """The draft head beside its ``target`` (whose embedding, and for EAGLE LM head, it reads; never registered
    as a submodule, so ``named_parameters`` are the head's own)."""

    def __init__(
        self, cfg: EagleConfig, target: LlamaForCausalLM, dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.device = device
        self.eagle3 = cfg.algorithm == EAGLE3
        object.__setattr__(self, "target", target)
        h = cfg.layer.hidden_size
        tp = target.tp
        # Raises ConfigError naming the head's folder when --tp-size cannot split its heads or MLP.
        self.shard = ShardLayout.for_config(cfg.layer, tp.tp_rank, tp.tp_size)
        self.fc = Linear(cfg.fc_in, h, cfg.fc_bias, dtype, device)
        self.layer = EagleDecoderLayer(cfg.layer, self.eagle3, dtype, device, self.shard, tp)
        self.norm = RMSNorm(h, cfg.layer.rms_norm_eps, dtype, device) if self.eagle3 else None
        self.lm_head = Linear(h, cfg.draft_vocab_size, False, dtype, device) if cfg.own_lm_head else None
        self.rotary = RotaryEmbedding(cfg.layer.rope, cfg.layer.head_dim).to(device)
        # draft id -> target id (EAGLE3's d2t: target = draft + d2t[draft]); None: the same vocab
        self.hot_token_ids: torch.Tensor | None = None

    @property
    def hidden_size(self) -> int:
        return self.config.layer.hidden_size

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank's head pool holds."""
        return self.shard.num_kv_heads

    def make_attn_backend(self, backend: str = "torch") -> TorchAttentionBackend | TritonAttentionBackend:
        sh, d = self.shard, self.config.layer.head_dim
        if backend == "triton":
            from common.engine.model.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend(sh.num_heads, sh.num_kv_heads, d, None, self.device)
        if backend != "torch":
            raise ValueError(f"unknown attention backend {backend!r} (torch or triton)")
        return TorchAttentionBackend(sh.num_heads, sh.num_kv_heads, d)

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows as in the module docstring: ``fb.input_ids`` [T] the token after each row's position, ``hidden``
        [T, target_feature_size] (the target's feature) or [T, hidden_size] (the head's own, from a draft step; for
        EAGLE the two are one width).
        Returns (the hidden the logits are read from, the next feature), both [T, hidden]. Writes the head's K/V of
        every row to ``fb.kv_pool`` (layer 0) at ``fb.out_cache_loc``."""
        if fb.attn_metadata is None:
            fb.attn_backend.init_forward_metadata(fb)
        embeds = self.target.model.embed_tokens(fb.input_ids)
        cos, sin = self.rotary.cos_signed_sin(fb.positions, embeds.dtype)
        if not self.eagle3:
            x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
            out, residual = self.layer(x, None, cos, sin, fb)
            out = out + residual
            return out, out
        x = hidden.to(embeds.dtype)
        if x.shape[-1] != self.hidden_size:
            x = self.fc(x)
        out, residual = self.layer(x, embeds, cos, sin, fb)
        assert self.norm is not None
        return self.norm.add_forward(out, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, draft_vocab_size] (column d is target token ``to_target_ids(d)``)."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.eagle3 and self.config.layer.tie_word_embeddings:
            return F.linear(hidden, self.target.model.embed_tokens.weight).float()
        return self.target.compute_logits(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.hot_token_ids is None else self.hot_token_ids[draft_ids]

    def draft_topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely next tokens of each row: (probabilities [n, k] fp32, target token ids [n, k])."""
        probs = torch.softmax(self.compute_logits(hidden), dim=-1)
        p, ids = probs.topk(k, dim=-1)
        return p, self.to_target_ids(ids)
