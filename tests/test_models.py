"""Our model forward over the paged KV pool vs transformers (fp32, eager), plus the model generator and loader."""

from __future__ import annotations

import json
import os
import random
import shutil
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from common.engine.forward_batch import ForwardMode
from common.engine.model.config import ModelConfig
from common.engine.model.loader import load_model
from common.errors import ModelLoadError
from common.model_gen import make_model
from common.model_gen.make_model import CHECK_PROMPTS, MIN_MEDIAN_MARGIN, default_model_path
from tests.model_fixtures import PagedHarness, hf_logits, load_tiny_model, make_tiny_model

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
ATOL = 1e-4


class Checker:
    """Runs forwards through a PagedHarness and checks every returned logit row against HF at its position."""

    def __init__(self, arch: str, page_size: int, seed: int = 0, scatter_slots: bool = False) -> None:
        self.path = make_tiny_model(arch)
        self.h = PagedHarness(load_tiny_model(arch), page_size, seed=seed, scatter_slots=scatter_slots)
        self.outputs: list[tuple[str, int, torch.Tensor]] = []  # (request, first position, logits)

    def run(self, batch: list[tuple[str, list[int]]], mode: ForwardMode | None = None) -> None:
        starts = [len(self.h.reqs[rid].tokens) for rid, _ in batch]
        for (rid, _), start, logits in zip(batch, starts, self.h.forward(batch, mode), strict=True):
            self.outputs.append((rid, start, logits))

    def verify(self) -> None:
        refs = {rid: hf_logits(self.path, req.tokens) for rid, req in self.h.reqs.items()}
        for rid, start, logits in self.outputs:
            ref = refs[rid][start : start + logits.shape[0]]
            err = (logits - ref).abs().max().item()
            assert err < ATOL, f"{rid} positions {start}..{start + logits.shape[0]}: max |diff| {err:.2e}"
            assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def _raw_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """Exactly tokenizer.json (AutoTokenizer adds NFC normalisation for qwen2 model types)."""
    return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 1500) for _ in range(n)]  # skip special tokens 0..4


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_then_decode_matches_hf(arch: str, page_size: int) -> None:
    rng = random.Random(1)
    lens = [5, 17, 33, 60]  # 60 + 8 > mistral tiny's sliding window (48)
    seqs = {f"r{i}": _tokens(rng, n + 8) for i, n in enumerate(lens)}
    c = Checker(arch, page_size)
    for rid in seqs:
        c.h.add(rid)
    c.run([(rid, seqs[rid][:n]) for rid, n in zip(seqs, lens, strict=True)])
    for step in range(8):
        c.run([(rid, [seqs[rid][n + step]]) for rid, n in zip(seqs, lens, strict=True)])
    c.verify()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_shared_prefix_and_mixed_match_hf(arch: str, page_size: int) -> None:
    rng = random.Random(2)
    a, b, cc = _tokens(rng, 80), _tokens(rng, 12), _tokens(rng, 22)
    c = Checker(arch, page_size, seed=3)
    for rid in ("a", "b", "c"):
        c.h.add(rid)
    c.run([("a", a[:32]), ("b", b[:10]), ("c", cc[:20])])  # a's first chunk
    c.run([("a", a[32:70]), ("b", [b[10]]), ("c", [cc[20]])], ForwardMode.MIXED)  # a's last chunk + decodes
    # d and e reuse a's KV pages for the shared prefix (as a radix-cache hit would); e extends by one token.
    d = a[:32] + _tokens(rng, 18)
    c.h.add("d", share_prefix_of="a", prefix_len=32)
    c.h.add("e", share_prefix_of="a", prefix_len=48)
    c.h.add("f")
    f = _tokens(rng, 7)
    c.run([("d", d[32:50]), ("a", [a[70]]), ("f", f), ("e", [a[48]]), ("b", [b[11]])], ForwardMode.MIXED)
    c.run([("a", [a[71]]), ("d", [rng.randrange(5, 1500)]), ("e", [a[49]]), ("f", [rng.randrange(5, 1500)])])
    c.verify()


@pytest.mark.parametrize("scatter_slots", [False, True])
def test_extend_with_many_chunks_in_one_batch_matches_hf(scatter_slots: bool) -> None:
    """Multi-token extends with different prefix and chunk lengths share one padded group; with slots that are
    not page-aligned the backend gathers single slots instead of pages."""
    rng = random.Random(4)
    seqs = {f"r{i}": _tokens(rng, 40) for i in range(4)}
    c = Checker("llama", 16, scatter_slots=scatter_slots)
    for rid in seqs:
        c.h.add(rid)
    c.run([(rid, seqs[rid][:n]) for rid, n in zip(seqs, [3, 16, 25, 2], strict=True)])
    c.run(
        [
            (rid, seqs[rid][a:b])
            for rid, (a, b) in zip(seqs, [(3, 40), (16, 19), (25, 40), (2, 9)], strict=True)
        ]
    )
    c.run([(rid, [seqs[rid][-1]]) for rid in seqs])
    assert c.h.last_batch is not None
    assert [g.unit for g in c.h.last_batch.attn_metadata.groups] == [1 if scatter_slots else 16]
    c.verify()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_margin_is_not_a_near_tie(arch: str) -> None:
    tok = _raw_tokenizer(make_tiny_model(arch))
    h = PagedHarness(load_tiny_model(arch), 1)
    batch = [(f"p{i}", tok(p)["input_ids"]) for i, p in enumerate(CHECK_PROMPTS)]
    for rid, _ in batch:
        h.add(rid)
    top2 = torch.cat(h.forward(batch)).topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).median()) > MIN_MEDIAN_MARGIN


def test_model_config_reads_arch_features() -> None:
    cfgs = {arch: ModelConfig.from_path(make_tiny_model(arch)) for arch in ARCHS}
    llama, qwen2, qwen3, mistral = (cfgs[a] for a in ARCHS)
    assert llama.architecture == "LlamaForCausalLM" and llama.rope.rope_type == "llama3"
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 32)
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings
    assert qwen3.qk_norm and qwen3.head_dim == 48 and not qwen3.qkv_bias
    assert mistral.sliding_window == 48 and llama.sliding_window is None and qwen2.sliding_window is None
    for cfg in cfgs.values():
        assert cfg.eos_token_ids == (1, 4) and cfg.bos_token_id == 0
        assert cfg.context_len == 2048 and cfg.dtype == torch.float32 and cfg.vocab_size == 1536


def test_fingerprint_is_stable_and_tells_models_apart() -> None:
    fp = ModelConfig.from_path(make_tiny_model("llama")).fingerprint()
    assert fp == ModelConfig.from_path(make_tiny_model("llama")).fingerprint()
    assert (
        fp["dtype"] == "float32"
        and fp["num_layers"] == 3
        and fp["num_kv_heads"] == 2
        and fp["head_dim"] == 32
    )
    other = ModelConfig.from_path(make_tiny_model("qwen3")).fingerprint()
    assert other["weights_sha256"] != fp["weights_sha256"]
    json.dumps(fp)  # travels in a control-plane message


def test_generator_is_deterministic(tmp_path: Path) -> None:
    p1 = make_model("qwen2", "tiny", tmp_path / "a", seed=3)
    p2 = make_model("qwen2", "tiny", tmp_path / "b", seed=3)
    p3 = make_model("qwen2", "tiny", tmp_path / "c", seed=4)
    names = sorted(f.name for f in p1.iterdir())
    assert names == sorted(f.name for f in p2.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (p1 / name).read_bytes() == (p2 / name).read_bytes(), name
    assert (p1 / "model.safetensors").read_bytes() != (p3 / "model.safetensors").read_bytes()
    assert (p1 / "tokenizer.json").read_bytes() == (p3 / "tokenizer.json").read_bytes()


def test_1b_preset_is_llama_1b_shaped_bf16(tmp_path: Path) -> None:
    """The ``1b`` preset's config (weights are not materialized: ~2 GB; the GPU tests generate them)."""
    from transformers import AutoModelForCausalLM

    from common.model_gen.make_model import SIZES, _hf_config
    from common.model_gen.tokenizer import write_tokenizer_files

    spec = SIZES["1b"]
    config = _hf_config("llama", "1b", spec, write_tokenizer_files(tmp_path, spec.vocab, spec.max_pos))
    config.save_pretrained(tmp_path)
    save_file({"placeholder": torch.zeros(1)}, str(tmp_path / "model.safetensors"))  # the folder check wants one
    cfg = ModelConfig.from_path(tmp_path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2048, 16, 32, 8)
    assert cfg.intermediate_size == 8192 and cfg.head_dim == 64
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with torch.device("meta"):
        params = sum(t.numel() for t in AutoModelForCausalLM.from_config(config).parameters())
    assert 0.95e9 < params < 1.3e9
    small = SIZES["small"]
    assert spec.vocab == small.vocab  # the same generated tokenizer as the other presets


def test_tokenizer_round_trips_any_utf8() -> None:
    rng = random.Random(5)
    texts = [
        "Hello, world! 1234567890",
        "emoji 🙂🚀👩‍👩‍👧 and CJK 中文文本 日本語 한국어",
        "tabs\tand\nnewlines\r\n  spaces   ",
        "e\u0301 (decomposed) vs é, \x00 \x7f \u200b",
        "<|im_start|>user\nhi<|im_end|>\n",
    ]
    for _ in range(20):
        texts.append(
            "".join(
                chr(
                    rng.choice(
                        [
                            rng.randrange(32, 0x2FF),
                            rng.randrange(0x4E00, 0x9FFF),
                            rng.randrange(0x1F300, 0x1FAFF),
                        ]
                    )
                )
                for _ in range(30)
            )
        )
    for arch in ARCHS:
        path = make_tiny_model(arch)
        tok = _raw_tokenizer(path)
        auto = AutoTokenizer.from_pretrained(path)
        for text in texts:
            assert tok.decode(tok(text)["input_ids"]) == text
            nfc = unicodedata.normalize("NFC", text)  # AutoTokenizer adds NFC for qwen2 model types
            assert auto.decode(auto(nfc)["input_ids"]) == nfc
            assert auto(nfc)["input_ids"] == tok(nfc)["input_ids"]


def test_chat_template_and_special_tokens() -> None:
    tok = AutoTokenizer.from_pretrained(make_tiny_model("llama"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(text)["input_ids"]
    assert (
        ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(4) == 2
    )  # <|im_end|> is one token
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")


def test_bf16_load_runs() -> None:
    model, _ = load_model(make_tiny_model("qwen3"), dtype=torch.bfloat16)
    h = PagedHarness(model, 16, kv_dtype=torch.bfloat16)
    h.add("a")
    logits = h.forward([("a", list(range(5, 40)))])[0]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def _broken_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(make_tiny_model("llama"), dst)
    return dst


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no_config", "config.json"),
        ("no_weights", "safetensors"),
        ("no_tokenizer", "tokenizer"),
        ("unknown_arch", "GPT2LMHeadModel"),
        ("unknown_model_type", "config.json"),
        ("not_a_dir", "not a directory"),
    ],
)
def test_unusable_model_folder_is_a_clear_error(tmp_path: Path, breakage: str, message: str) -> None:
    path = _broken_copy(tmp_path)
    config = json.loads((path / "config.json").read_text())
    if breakage == "no_config":
        (path / "config.json").unlink()
    elif breakage == "no_weights":
        (path / "model.safetensors").unlink()
    elif breakage == "no_tokenizer":
        (path / "tokenizer.json").unlink()
    elif breakage == "unknown_arch":
        config["architectures"] = ["GPT2LMHeadModel"]
    elif breakage == "unknown_model_type":
        config["model_type"] = "no_such_model"
    else:
        path = path / "model.safetensors"
    if breakage.startswith("unknown"):
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)


def test_missing_or_misshapen_weight_is_a_clear_error(tmp_path: Path) -> None:
    path = _broken_copy(tmp_path)
    weights = load_file(path / "model.safetensors")
    q = weights.pop("model.layers.1.self_attn.q_proj.weight")
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing.*layers\.1\.self_attn\.qkv_proj"):
        load_model(path)
    weights["model.layers.1.self_attn.q_proj.weight"] = q[:, :-1].contiguous()
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(path)


def test_default_model_path_generates_once_even_when_raced(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(default_model_path, [tmp_path, tmp_path]))
    path = tmp_path / "models" / "llama-small-s0"
    assert paths == [path, path]
    assert [p.name for p in path.parent.iterdir()] == ["llama-small-s0"]  # the loser's temp folder is gone
    weights = path / "model.safetensors"
    mtime = os.stat(weights).st_mtime_ns
    assert default_model_path(tmp_path) == path and os.stat(weights).st_mtime_ns == mtime
    cfg = ModelConfig.from_path(path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (512, 8, 8, 2)
    assert cfg.vocab_size == 8192 and cfg.context_len == 4096 and cfg.rope.rope_type == "llama3"


def test_default_model_path_of_another_size_is_that_size_beside_the_default(tmp_path: Path) -> None:
    path = default_model_path(tmp_path, size="tiny")  # the soak's --model-size tiny
    assert path == tmp_path / "models" / "llama-tiny-s0"
    cfg = ModelConfig.from_path(path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.context_len) == (128, 3, 1536, 2048)
    assert not (tmp_path / "models" / "llama-small-s0").exists()
