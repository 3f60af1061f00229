"""The tensor-parallel sharded model on CPU: real spawned ranks joined over gloo, checked against transformers.

Each case spawns ``tp`` rank processes (``tests/tp_helpers.run_ranks``: one gloo group on a free 127.0.0.1 port). Every rank
builds a ``ModelRunner`` (its shard, its KV pool sized by the group's MIN), then runs a batched prefill and several
decode steps through ``PagedHarness`` (hand-built ``ForwardBatch``es, as tests/test_models.py does) and sends its
logits, parameter shapes and the weights it read whole back to the parent. The parent checks rank 0's logits
against HF (fp32) and that every rank's logits are bitwise identical.

Module imports stay light (no transformers): spawned ranks import this module to find their entry point.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from common.engine.distributed import TPGroup
from common.engine.model.config import ModelConfig
from common.engine.model.parallel import ShardLayout, owned_kv_heads
from common.errors import ConfigError
from kvtransfer.pages import owned_heads
from tests.model_fixtures import make_tiny_model
from tests.tp_helpers import run_ranks

pytestmark = pytest.mark.slow  # spawns rank processes

ATOL = 1e-4
PAGE_SIZE = 16
PROMPT_LENS = (9, 21)
DECODE_STEPS = 4


# -- rank processes ------------------------------------------------------------------------------------------------
class _RecordingSafeOpen:
    """``safe_open`` that records which tensors are read whole (``get_tensor``) rather than sliced."""

    whole: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from safetensors import safe_open

        self._f = safe_open(*args, **kwargs)

    def __enter__(self) -> _RecordingSafeOpen:
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def get_slice(self, name: str) -> Any:
        return self._f.get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        _RecordingSafeOpen.whole.append(name)
        return self._f.get_tensor(name)


def _rank_main(group: TPGroup, cases: list[tuple[str, list[list[int]]]]) -> list[dict[str, Any]]:
    """One rank: for each (model folder, token sequences) case, a ModelRunner, a prefill and decode steps."""
    import common.engine.model.loader as loader

    loader.safe_open = _RecordingSafeOpen  # type: ignore[attr-defined]
    return [_run_case(group, path, seqs) for path, seqs in cases]


def _run_case(group: TPGroup, model_path: str, seqs: list[list[int]]) -> dict[str, Any]:
    from common.config import ServerArgs
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.model_runner import ModelRunner
    from tests.model_fixtures import PagedHarness

    _RecordingSafeOpen.whole = []
    # A tiny fraction of host RAM: the page count differs per rank unless the group agrees on the MIN.
    args = ServerArgs(mem_fraction_static=2e-4, page_size=PAGE_SIZE, max_running_requests=4)
    runner = ModelRunner(args, model_path, tp=group)
    cfg = runner.model_config
    h = PagedHarness(runner.model, PAGE_SIZE)
    rids = [f"r{i}" for i in range(len(seqs))]
    for rid in rids:
        h.add(rid)
    logits = [torch.cat(h.forward([(rid, s[:n]) for rid, s, n in zip(rids, seqs, PROMPT_LENS, strict=True)]))]
    for step in range(DECODE_STEPS):
        logits.append(torch.cat(h.forward([(rid, [s[n + step]]) for rid, s, n in
                                           zip(rids, seqs, PROMPT_LENS, strict=True)])))
    pool = runner.kv_pool
    # numpy, not tensors: torch would share tensor storage through a listener that dies with the rank process.
    return {
        "logits": [t.numpy() for t in logits],
        "shapes": {n: tuple(p.shape) for n, p in runner.model.named_parameters()},
        "whole": sorted(set(_RecordingSafeOpen.whole)),
        "pool_pages": pool.num_pages,
        "pool_kv_heads": pool.num_kv_heads,
        "pool_bytes_per_token": MHATokenToKVPool.bytes_per_token(
            pool.num_kv_heads, pool.head_dim, pool.num_layers, pool.dtype),
        "full_bytes_per_token": MHATokenToKVPool.bytes_per_token(
            cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, pool.dtype),
    }


def run_tp(tp_size: int, cases: list[tuple[Path, list[list[int]]]]) -> list[list[dict[str, Any]]]:
    """Run the cases on ``tp_size`` spawned ranks: results[case][rank]."""
    results = run_ranks(_rank_main, tp_size, [(str(path), seqs) for path, seqs in cases])
    for res in results:
        for case in res:
            case["logits"] = [torch.from_numpy(a) for a in case["logits"]]
    return [[results[r][c] for r in range(tp_size)] for c in range(len(cases))]


# -- models --------------------------------------------------------------------------------------------------------
def kv1_model(arch: str, dst: Path, vocab: int) -> Path:
    """``arch``'s tiny model cut to ONE KV head (the first) and ``vocab`` tokens: with tp 2 the KV head is
    replicated and the vocab-parallel LM head is padded."""
    from safetensors.torch import load_file, save_file

    src = make_tiny_model(arch)
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    config["num_key_value_heads"] = 1
    config["vocab_size"] = vocab
    (dst / "config.json").write_text(json.dumps(config))
    weights = load_file(src / "model.safetensors")
    for name, t in weights.items():
        if ".k_proj." in name or ".v_proj." in name:
            weights[name] = t[:head_dim].contiguous()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = t[:vocab].contiguous()
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _seqs(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1500) for _ in range(n + DECODE_STEPS)] for n in PROMPT_LENS]


def check_against_hf(path: Path, seqs: list[list[int]], ranks: list[dict[str, Any]]) -> None:
    """Rank 0's logits match HF's at the prefill and every decode step; every rank's are bitwise rank 0's."""
    from tests.model_fixtures import hf_logits

    refs = [hf_logits(path, s) for s in seqs]
    vocab = ModelConfig.from_path(path).vocab_size
    expect = [torch.cat([ref[:n] for ref, n in zip(refs, PROMPT_LENS, strict=True)])]
    expect += [torch.stack([ref[n + step] for ref, n in zip(refs, PROMPT_LENS, strict=True)])
               for step in range(DECODE_STEPS)]
    for step, (got, ref) in enumerate(zip(ranks[0]["logits"], expect, strict=True)):
        assert got.shape == ref.shape == (ref.shape[0], vocab)
        err = (got - ref).abs().max().item()
        assert err < ATOL, f"{path.name} step {step} (0 = prefill): max |diff| {err:.2e} vs HF"
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    for r, other in enumerate(ranks[1:], start=1):
        for step, (a, b) in enumerate(zip(ranks[0]["logits"], other["logits"], strict=True)):
            assert torch.equal(a, b), f"{path.name}: rank {r} logits differ from rank 0 at step {step}"
    pages = {res["pool_pages"] for res in ranks}
    assert len(pages) == 1, f"KV pool page counts differ over the group: {pages}"


TP2_CASES = ("llama", "qwen3", "qwen2-kv1")


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict[str, Any]]]]:
    """The tp 2 cases, run by ONE spawned group (process start-up dominates on CPU): name -> (folder, ranks)."""
    paths = {
        "llama": make_tiny_model("llama"),
        "qwen3": make_tiny_model("qwen3"),
        "qwen2-kv1": kv1_model("qwen2", tmp_path_factory.mktemp("tp") / "qwen2-kv1", vocab=1535),
    }
    seqs = {name: _seqs(i) for i, name in enumerate(TP2_CASES)}
    results = run_tp(2, [(paths[name], seqs[name]) for name in TP2_CASES])
    for name, ranks in zip(TP2_CASES, results, strict=True):
        check_against_hf(paths[name], seqs[name], ranks)
    return {name: (paths[name], ranks) for name, ranks in zip(TP2_CASES, results, strict=True)}


# -- tests ---------------------------------------------------------------------------------------------------------
def test_tp2_llama_splits_kv_heads_and_matches_hf(tp2: dict[str, tuple[Path, list[dict[str, Any]]]]) -> None:
    path, ranks = tp2["llama"]
    cfg = ModelConfig.from_path(path)  # heads 4, kv heads 2, intermediate 256, hidden 128, head_dim 32
    d = cfg.head_dim
    for res in ranks:
        shapes = res["shapes"]
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((2 + 1 + 1) * d, cfg.hidden_size)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (cfg.hidden_size, 2 * d)
        assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (cfg.intermediate_size, cfg.hidden_size)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (cfg.hidden_size, cfg.intermediate_size // 2)
        assert shapes["lm_head.weight"] == (cfg.vocab_size // 2, cfg.hidden_size)
        assert shapes["model.embed_tokens.weight"] == (cfg.vocab_size, cfg.hidden_size)
        # Only replicated weights are read whole; every sharded one through a slice.
        assert res["whole"] and all(n.endswith("norm.weight") or n == "model.embed_tokens.weight"
                                    for n in res["whole"]), res["whole"]
        assert res["pool_kv_heads"] == 1
        assert res["pool_bytes_per_token"] * 2 == res["full_bytes_per_token"]


def test_tp2_qwen3_qk_norm_matches_hf(tp2: dict[str, tuple[Path, list[dict[str, Any]]]]) -> None:
    _, ranks = tp2["qwen3"]
    for res in ranks:
        assert res["shapes"]["model.layers.0.self_attn.q_norm.weight"] == (48,)  # per head_dim, replicated
        assert res["pool_kv_heads"] == 1


def test_tp2_replicated_kv_head_qkv_bias_tied_padded_vocab_matches_hf(
    tp2: dict[str, tuple[Path, list[dict[str, Any]]]],
) -> None:
    """qwen2 (qkv bias, tied embeddings) with one KV head and an odd vocab (1535): both ranks hold KV head 0, and
    the LM head shards (read from the embedding) are padded to 768 rows."""
    path, ranks = tp2["qwen2-kv1"]
    d = ModelConfig.from_path(path).head_dim
    for res in ranks:
        assert res["shapes"]["model.layers.0.self_attn.qkv_proj.bias"] == ((2 + 1 + 1) * d,)
        assert res["shapes"]["lm_head.weight"][0] == 768
        assert res["pool_kv_heads"] == 1 and res["pool_bytes_per_token"] == res["full_bytes_per_token"]


def test_tp4_on_two_kv_heads_replicates_and_matches_hf() -> None:
    path, seqs = make_tiny_model("llama"), _seqs(3)
    (ranks,) = run_tp(4, [(path, seqs)])
    check_against_hf(path, seqs, ranks)
    assert [res["pool_kv_heads"] for res in ranks] == [1] * 4
    assert [res["shapes"]["model.layers.0.self_attn.qkv_proj.weight"][0] for res in ranks] == [3 * 32] * 4


def test_tp_size_that_does_not_split_the_model_is_a_clear_error() -> None:
    from common.engine.model.llama import LlamaForCausalLM

    cfg = ModelConfig.from_path(make_tiny_model("llama"))
    with pytest.raises(ConfigError, match=r"--tp-size 3 does not divide the 4 attention heads"):
        LlamaForCausalLM(cfg, tp=TPGroup(tp_rank=0, tp_size=3))  # no process group: checked before any collective
    from dataclasses import replace

    with pytest.raises(ConfigError, match=r"--tp-size 2 and the 3 KV heads"):
        ShardLayout.for_config(replace(cfg, num_kv_heads=3), 0, 2)
    with pytest.raises(ConfigError, match=r"--tp-size 4 does not divide intermediate_size 258"):
        ShardLayout.for_config(replace(cfg, intermediate_size=258), 0, 4)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 8), (32, 8), (8, 1), (16, 4)])
def test_kv_head_ownership_is_one_rule_and_covers_each_rank_query_heads(heads: int, kv_heads: int) -> None:
    for tp in (t for t in (1, 2, 4, 8) if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)):
        for r in range(tp):
            assert owned_heads(r, tp, kv_heads) == owned_kv_heads(r, tp, kv_heads)
            held = owned_kv_heads(r, tp, kv_heads)
            q = range(r * heads // tp, (r + 1) * heads // tp)
            assert {h // (heads // kv_heads) for h in q} <= set(held)  # its query heads attend with its KV heads
        assert {h for r in range(tp) for h in owned_kv_heads(r, tp, kv_heads)} == set(range(kv_heads))
