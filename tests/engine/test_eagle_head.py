"""The EAGLE / EAGLE3 draft head (``common.engine.spec.eagle_model``) against a reference built from transformers'
Llama modules and the same checkpoint, the target's captured hidden states against HF's, and the loader's errors."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from common.engine.forward_batch import ForwardBatch, ForwardMode
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.spec.eagle_loader import load_eagle_head
from common.engine.spec.eagle_model import EagleHead
from common.errors import ModelLoadError
from common.model_gen.make_eagle import make_eagle_head
from tests.model_fixtures import _session_dir, hf_model, load_tiny_model, make_tiny_model

PAGE = 4


@functools.cache
def head_dir(kind: str) -> Path:
    return make_eagle_head(make_tiny_model("llama"), _session_dir() / f"llama-tiny-{kind}", kind, seed=3)


def _reference(kind: str, ids: torch.Tensor, hidden: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama attention / MLP / norms / RoPE over all rows at once, causal, from the checkpoint:
    (the hidden the logits read, the next feature). ``hidden[r]``: the target's feature or (EAGLE3) the head's own."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaMLP,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )

    w = load_file(str(head_dir(kind) / "model.safetensors"))
    raw = json.loads((head_dir(kind) / "config.json").read_text())
    cfg = LlamaConfig(**{k: raw[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                             "num_key_value_heads", "head_dim", "rms_norm_eps",
                                             "max_position_embeddings", "vocab_size")},
                      rope_parameters=raw["rope_scaling"])
    cfg._attn_implementation = "eager"
    hsz, pre = cfg.hidden_size, ("layers.0." if kind == "EAGLE" else "midlayer.")
    attn = LlamaAttention(cfg, 0)
    if kind == "EAGLE3":
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, torch.nn.Linear(2 * hsz, getattr(attn, name).out_features, bias=False))
    mlp = LlamaMLP(cfg)
    layer_w = {k.removeprefix(pre): v for k, v in w.items() if k.startswith(pre)}
    attn.load_state_dict({k.removeprefix("self_attn."): v for k, v in layer_w.items() if k.startswith("self_attn.")})
    mlp.load_state_dict({k.removeprefix("mlp."): v for k, v in layer_w.items() if k.startswith("mlp.")})

    def norm(name: str) -> LlamaRMSNorm:
        n = LlamaRMSNorm(hsz, cfg.rms_norm_eps)
        n.weight.data.copy_(w[name])
        return n

    embeds = hf_model(make_tiny_model("llama")).model.embed_tokens(ids)
    rows = []
    for r, f in enumerate(hidden):
        if kind == "EAGLE":
            rows.append(F.linear(torch.cat([embeds[r], f]), w["fc.weight"], w["fc.bias"]))
        else:
            rows.append(F.linear(f, w["fc.weight"]) if f.shape[-1] != hsz else f)
    x = torch.stack(rows)
    n = len(rows)
    cos, sin = LlamaRotaryEmbedding(cfg)(x[None], torch.arange(n)[None])
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    attn_in = x if kind == "EAGLE" else torch.cat([norm(pre + "input_layernorm.weight")(embeds),
                                                   norm(pre + "hidden_norm.weight")(x)], dim=-1)
    r = x + attn(attn_in[None], (cos, sin), causal)[0][0]
    out = mlp(norm(pre + "post_attention_layernorm.weight")(r)) + r
    return (out, out) if kind == "EAGLE" else (norm("norm.weight")(out), out)


def _head_batch(head: EagleHead, pool: MHATokenToKVPool, ids: list[int], start: int) -> ForwardBatch:
    """One request, rows at positions start .. start + len(ids) - 1, slots on shuffled pages (7, 2, 5, ...)."""
    pages = [7, 2, 5, 3, 6]
    r2t = torch.tensor([[pages[p // PAGE] * PAGE + p % PAGE for p in range(len(pages) * PAGE)]])
    n, i64 = start + len(ids), torch.int64
    return ForwardBatch(
        ForwardMode.EXTEND if len(ids) > 1 else ForwardMode.DECODE, 1, torch.tensor(ids, dtype=i64),
        torch.arange(start, n), r2t[0, start:n].clone(), torch.tensor([0]), torch.tensor([n]),
        torch.tensor([len(ids)]), torch.tensor([start]), r2t, [n], [len(ids)], [start], pool, head.make_attn_backend(),
    )


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_head_matches_reference_over_its_paged_kv(kind: str) -> None:
    """An extend of 9 rows, then one decode row reading their K/V from the head's pool (EAGLE3: fed its own
    feature, no fc), against the reference over all 10 rows; the logits and the top-k's target ids too."""
    target = load_tiny_model("llama")
    head = load_eagle_head(head_dir(kind), kind, target)
    gen = torch.Generator().manual_seed(5)
    ids = [int(t) for t in torch.randint(3, 1500, (10,), generator=gen)]
    feats = [torch.randn(head.config.target_feature_size, generator=gen) for _ in range(9)]
    pool = MHATokenToKVPool(8, PAGE, torch.float32, head.num_kv_heads, head.config.layer.head_dim, 1)
    with torch.inference_mode():
        logit_h, nxt = head(_head_batch(head, pool, ids[:9], 0), torch.stack(feats))
        last_feat = nxt[-1] if kind == "EAGLE3" else torch.randn(head.config.target_feature_size, generator=gen)
        step_h, step_next = head(_head_batch(head, pool, ids[9:], 9), last_feat[None])
        ref_h, ref_next = _reference(kind, torch.tensor(ids), [*feats, last_feat])
    assert (torch.cat([logit_h, step_h]) - ref_h).abs().max() < 1e-4
    assert (torch.cat([nxt, step_next]) - ref_next).abs().max() < 1e-4
    logits = head.compute_logits(step_h)
    if kind == "EAGLE3":
        w = load_file(str(head_dir(kind) / "model.safetensors"))
        assert logits.shape[-1] == w["lm_head.weight"].shape[0] < target.config.vocab_size
        assert (logits - F.linear(ref_h[-1:], w["lm_head.weight"])).abs().max() < 1e-3
        _, top = head.draft_topk(step_h, 3)
        draft = logits.topk(3).indices
        assert torch.equal(top, draft + w["d2t"][draft])  # the d2t offsets, target ids
    else:
        assert (logits - target.compute_logits(ref_h[-1:])).abs().max() < 1e-3


def test_target_captures_layer_inputs() -> None:
    """``forward_capture`` returns the residual streams entering the named layers (num_layers: the last layer's
    output before the final norm), in layer order, as HF's hidden_states has them; the output is unchanged."""
    from tests.model_fixtures import PagedHarness

    model = load_tiny_model("llama")
    ids = [5, 77, 300, 12, 9, 41]
    h = PagedHarness(model, page_size=PAGE)
    h.add("a")
    h.forward([("a", ids)])
    plain = model(h.last_batch)
    h2 = PagedHarness(model, page_size=PAGE)
    h2.add("a")
    h2.forward([("a", ids)])
    fb = h2.last_batch
    fb.attn_metadata = None
    with torch.inference_mode():
        out, aux = model.forward_capture(fb, frozenset({2, 0, 3}))
        hf = hf_model(make_tiny_model("llama"))(torch.tensor([ids]), output_hidden_states=True).hidden_states
    hsz = model.config.hidden_size
    assert aux.shape == (len(ids), 3 * hsz)
    assert (aux[:, :hsz] - hf[0][0]).abs().max() < 1e-4  # layer 0's input: the embedding
    assert (aux[:, hsz : 2 * hsz] - hf[2][0]).abs().max() < 1e-4
    last = aux[:, 2 * hsz :]
    assert (model.model.norm(last) - out).abs().max() < 1e-5  # the final norm of the last layer's output
    assert (out - plain).abs().max() < 1e-6


def _variant(tmp_path: Path, kind: str, config: dict | None = None, drop: str | None = None) -> Path:
    out = tmp_path / "head"
    shutil.copytree(head_dir(kind), out)
    if config:
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**raw, **config}))
    if drop:
        w = load_file(str(out / "model.safetensors"))
        del w[drop]
        save_file(w, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize(("kind", "load_as", "config", "drop", "message"), [
    ("EAGLE3", "EAGLE", None, None, "holds an EAGLE3 head .* pass --speculative-algorithm EAGLE3"),
    ("EAGLE", "EAGLE3", None, None, "holds an EAGLE head"),
    ("EAGLE", "EAGLE", {"vocab_size": 999}, None, "vocab_size 999 differs"),
    ("EAGLE3", "EAGLE3", None, "d2t", "no d2t mapping"),
    ("EAGLE3", "EAGLE3", None, "midlayer.hidden_norm.weight", "missing or incomplete for layer.hidden_norm"),
    ("EAGLE3", "EAGLE3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}}, None, "3 distinct"),
])
def test_loader_refuses_a_head_it_cannot_run(
    tmp_path: Path, kind: str, load_as: str, config: dict | None, drop: str | None, message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_eagle_head(_variant(tmp_path, kind, config, drop), load_as, load_tiny_model("llama"))


def test_loader_reads_pytorch_bin_and_model_prefix(tmp_path: Path) -> None:
    """A ``pytorch_model.bin`` checkpoint with ``model.``-prefixed names loads to the same head."""
    out = tmp_path / "bin"
    out.mkdir()
    shutil.copy(head_dir("EAGLE3") / "config.json", out)
    torch.save({"model." + k: v for k, v in load_file(str(head_dir("EAGLE3") / "model.safetensors")).items()},
               out / "pytorch_model.bin")
    target = load_tiny_model("llama")
    a, b = load_eagle_head(out, "EAGLE3", target), load_eagle_head(head_dir("EAGLE3"), "EAGLE3", target)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert a.hot_token_ids is not None and b.hot_token_ids is not None
    assert torch.equal(a.hot_token_ids, b.hot_token_ids)
