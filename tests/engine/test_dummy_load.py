"""``--load-format dummy``: seeded random weights from config.json alone, the same as HF's model built from the
config and filled alike (``common.model_gen.hf_dummy``), TP shards slices of the same full weights, and the 8B
folder that ``make-model --size 8b`` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.config import ServerArgs
from common.engine.distributed import TPGroup
from common.engine.model.config import ModelConfig
from common.engine.model.llama import LlamaForCausalLM
from common.engine.model.loader import fill_dummy_model, load_model
from common.errors import ConfigError, ModelLoadError
from common.model_gen import make_model
from common.model_gen.hf_dummy import hf_dummy_model
from tests.model_fixtures import PagedHarness


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny llama (untied) and qwen2 (tied embeddings, qkv bias) folders without weight files."""
    root = tmp_path_factory.mktemp("dummy")
    return {arch: make_model(arch, "tiny", root / arch, weights=False) for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dummy_logits_equal_hf_built_from_the_same_config(config_only: dict[str, Path], arch: str) -> None:
    path = config_only[arch]
    assert not list(path.glob("*.safetensors"))
    model, cfg = load_model(path, load_format="dummy")
    assert cfg.load_format == "dummy"
    h = PagedHarness(model, page_size=4)
    prompt = [7, 300, 41, 999, 12, 5, 77, 1200, 64, 3]
    h.add("r")
    ours = h.forward([("r", prompt)])[0]
    steps = [ours]
    for tok in (17, 230):  # two decode steps over the paged KV
        steps.append(h.forward([("r", [tok])])[0])
    ref = hf_dummy_model(path, torch.float32, "cpu", attn_implementation="eager")
    with torch.inference_mode():
        want = ref(torch.tensor([[*prompt, 17, 230]])).logits[0].float()
    got = torch.cat(steps)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert want.std() > 0.5  # not a degenerate model: the weights carry signal
    again, _ = load_model(path, load_format="dummy")  # seeded: the same every time
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_tp2_shards_are_slices_of_the_full_weights(config_only: dict[str, Path]) -> None:
    cfg = ModelConfig.from_path(config_only["llama"], "dummy")  # heads 4, kv heads 2, intermediate 256
    full = LlamaForCausalLM(cfg)
    fill_dummy_model(full, cfg)
    w = dict(full.named_parameters())
    d, q, kv, inter = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for rank in range(2):
        shard = LlamaForCausalLM(cfg, tp=TPGroup(tp_rank=rank, tp_size=2))  # no process group: nothing runs
        fill_dummy_model(shard, cfg)
        s = dict(shard.named_parameters())
        qkv, qs, ks = w["model.layers.1.self_attn.qkv_proj.weight"], slice(rank * 2 * d, (rank + 1) * 2 * d), \
            slice(rank * d, (rank + 1) * d)
        assert torch.equal(s["model.layers.1.self_attn.qkv_proj.weight"],
                           torch.cat([qkv[:q][qs], qkv[q:q + kv][ks], qkv[q + kv:][ks]]))
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        gate_up = w["model.layers.0.mlp.gate_up_proj.weight"]
        assert torch.equal(s["model.layers.0.mlp.gate_up_proj.weight"],
                           torch.cat([gate_up[:inter][half], gate_up[inter:][half]]))
        assert torch.equal(s["model.layers.0.mlp.down_proj.weight"], w["model.layers.0.mlp.down_proj.weight"][:, half])
        assert torch.equal(s["model.layers.2.self_attn.o_proj.weight"],
                           w["model.layers.2.self_attn.o_proj.weight"][:, qs])
        rows = shard.shard.vocab_rows
        assert torch.equal(s["lm_head.weight"][:len(rows)], w["lm_head.weight"][rows.start:rows.stop])
        for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
            assert torch.equal(s[name], w[name]), name


def test_config_only_folder_needs_load_format_dummy(config_only: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match="--load-format dummy"):
        load_model(config_only["llama"])
    with pytest.raises(ConfigError, match="load-format"):
        ServerArgs(load_format="safetensors")


def test_make_model_8b_writes_config_and_tokenizer_only(tmp_path: Path) -> None:
    path = make_model("llama", "8b", tmp_path / "8b")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "generation_config.json",
                                                      "special_tokens_map.json", "tokenizer.json",
                                                      "tokenizer_config.json"]
    hf = json.loads((path / "config.json").read_text())
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
            hf["intermediate_size"], hf["vocab_size"], hf["dtype"]) == (4096, 32, 32, 8, 14336, 128256, "bfloat16")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == 128256 and tok.decode([128255]) == "<|t128255|>"  # every id decodes
    cfg = ModelConfig.from_path(path, "dummy")
    with torch.device("meta"):  # the whole 8B fill, shapes and slices only (nothing allocated)
        model = LlamaForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
        fill_dummy_model(model, cfg)
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9
    with pytest.raises(ValueError, match="--load-format dummy"):
        make_model("llama", "8b", tmp_path / "again", weights=True)
