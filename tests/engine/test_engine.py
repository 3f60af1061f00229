"""The colocated engine produces exactly the greedy tokens of Hugging Face transformers, for every batch
composition, page size, chunk size, prefix-cache and mixed-chunk setting, and under KV pressure (retraction)."""

from __future__ import annotations

import itertools
import random
from functools import cache
from pathlib import Path

import pytest
import torch

from common.errors import CapacityError, InvalidRequestError, ModelLoadError
from tests.model_fixtures import make_tiny_model

NEW_TOKENS = 12


@cache
def hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # compare whole sequences; our requests set ignore_eos
    return model.eval()


@cache
def hf_greedy(path: str, prompt: tuple[int, ...], n: int) -> list[int]:
    model = hf_model(path)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def make_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llama() -> Path:
    return make_tiny_model("llama")


def overlap_flags(on: bool) -> dict[str, bool]:
    """Force the overlap schedule on or off (by default a CPU rank whose threads take every core runs without)."""
    return {"enable_overlap_schedule": on, "disable_overlap_schedule": not on}


def greedy(n: int = NEW_TOKENS) -> dict[str, object]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


LENGTHS = [1, 7, 33, 64, 100, 150, 257, 300]
MATRIX = list(itertools.product([1, 16], [-1, 32], [False, True], [False, True], [True, False]))


@pytest.mark.parametrize(("page_size", "chunk", "disable_radix", "mixed", "overlap"), MATRIX)
def test_greedy_matches_hf(engine_factory, llama, page_size, chunk, disable_radix, mixed, overlap) -> None:
    vocab = 1000
    prompts = make_prompts(vocab, LENGTHS, seed=page_size + chunk)
    engine = engine_factory(
        llama,
        page_size=page_size,
        chunked_prefill_size=chunk,
        disable_radix_cache=disable_radix,
        enable_mixed_chunk=mixed,
        **overlap_flags(overlap),
    )
    outs = engine.generate(input_ids=prompts, sampling_params=greedy())
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_ids == hf_greedy(str(llama), tuple(prompt), NEW_TOKENS), f"prompt len {len(prompt)}"
        assert out.finish_reason == "length"


def test_staggered_arrivals_mix_prefill_and_decode(engine_factory, llama) -> None:
    """Requests arriving while others decode land in mixed batches and still match HF."""
    import asyncio

    prompts = make_prompts(1000, [40, 90, 5, 130, 60, 200], seed=7)
    engine = engine_factory(llama, chunked_prefill_size=32, enable_mixed_chunk=True, page_size=16)

    async def run() -> list[list[int]]:
        async def one(i: int, p: list[int]) -> list[int]:
            await asyncio.sleep(0.02 * i)
            ids: list[int] = []
            async for chunk in engine.generate_stream(input_ids=p, sampling_params=greedy(16)):
                ids.extend(chunk.token_ids)
            return ids

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    for p, ids in zip(prompts, results, strict=True):
        assert ids == hf_greedy(str(llama), tuple(p), 16)


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_hits_cache_with_same_outputs(engine_factory, llama, page_size) -> None:
    rng = random.Random(3)
    prefix = [rng.randrange(10, 1000) for _ in range(96)]
    prompts = [prefix + [rng.randrange(10, 1000) for _ in range(n)] for n in (3, 17, 40)]
    engine = engine_factory(llama, page_size=page_size)
    first = engine.generate(input_ids=prompts[0], sampling_params=greedy())
    assert first.cached_tokens == 0
    rest = engine.generate(input_ids=prompts[1:], sampling_params=greedy())
    for p, out in zip(prompts[1:], rest, strict=True):
        assert out.cached_tokens >= 96 // page_size * page_size - page_size
        assert out.cached_tokens > 0
        assert out.output_ids == hf_greedy(str(llama), tuple(p), NEW_TOKENS)


@pytest.mark.parametrize(("disable_radix", "overlap"), itertools.product([False, True], [True, False]))
def test_retraction_under_kv_pressure_keeps_outputs(engine_factory, llama, disable_radix, overlap) -> None:
    prompts = make_prompts(1000, [30, 45, 20, 60, 35, 50, 25, 40], seed=11)
    n = 48
    engine = engine_factory(llama, max_total_tokens=400, page_size=1, disable_radix_cache=disable_radix,
                            **overlap_flags(overlap))
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(n))
    assert engine.scheduler.decode.num_retracted > 0, "the KV budget was meant to force a retraction"
    for p, out in zip(prompts, outs, strict=True):
        assert out.output_ids == hf_greedy(str(llama), tuple(p), n)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_architectures_match_hf(engine_factory, arch) -> None:
    path = make_tiny_model(arch)
    prompts = make_prompts(1000, [5, 80, 33], seed=5)
    engine = engine_factory(path, page_size=16, chunked_prefill_size=32)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy())
    for p, out in zip(prompts, outs, strict=True):
        assert out.output_ids == hf_greedy(str(path), tuple(p), NEW_TOKENS)


def test_text_prompt_stop_string_and_eos(engine_factory, llama) -> None:
    engine = engine_factory(llama)
    full = engine.generate(prompt="Hello world", sampling_params=greedy(16))
    assert len(full.output_ids) == 16
    stop = full.text[4:7]
    if stop.strip():
        cut = engine.generate(prompt="Hello world", sampling_params={**greedy(16), "stop": [stop]})
        assert cut.finish_reason == "stop"
        assert cut.text == full.text[: full.text.find(stop)]
    tok = full.output_ids[3]
    by_id = engine.generate(prompt="Hello world", sampling_params={**greedy(16), "stop_token_ids": [tok]})
    assert by_id.finish_reason == "stop" and by_id.output_ids[-1] == tok
    assert by_id.output_ids == full.output_ids[: full.output_ids.index(tok) + 1]


def test_logprobs_and_seeded_sampling(engine_factory, llama) -> None:
    engine = engine_factory(llama)
    out = engine.generate(prompt="abc", sampling_params=greedy(5), top_logprobs_num=3)
    assert len(out.logprobs) == 5 and all(lp <= 0 for lp in out.logprobs)
    assert all(
        len(t) == 3 and t[0][0] == tok for t, tok in zip(out.top_logprobs, out.output_ids, strict=True)
    )
    sp = {"max_new_tokens": 10, "temperature": 1.0, "seed": 42, "ignore_eos": True}
    a = engine.generate(prompt="seeded", sampling_params=sp)
    b = engine.generate(prompt=["other prompt", "seeded", "x"], sampling_params=sp)
    assert a.output_ids == b[1].output_ids


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_bad_sampling_params_rejected(engine_factory, llama, params, field) -> None:
    engine = engine_factory(llama)
    with pytest.raises(InvalidRequestError, match=field):
        engine.generate(prompt="hi", sampling_params=params)
    assert engine.generate(prompt="hi", sampling_params=greedy(2)).output_ids  # still serving


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"prompt": "hi", "input_ids": [11, 12]}, "exactly one of prompt or input_ids"),
        ({"prompt": ["hi", "yo"], "input_ids": [[11]]}, "exactly one of prompt or input_ids"),
        ({"input_ids": ["11", "12"]}, "list of token ids"),
        ({"input_ids": {"max_new_tokens": 4}}, "list of token ids"),
    ],
)
def test_bad_prompt_arguments_rejected(engine_factory, llama, kw, match) -> None:
    engine = engine_factory(llama)
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate(sampling_params=greedy(2), **kw)
    assert engine.generate(prompt="hi", sampling_params=greedy(2)).output_ids  # still serving


def test_prompt_longer_than_context_rejected(engine_factory, llama) -> None:
    engine = engine_factory(llama)
    too_long = [11] * (engine.model_config.context_len + 1)
    with pytest.raises(CapacityError, match="context"):
        engine.generate(input_ids=too_long, sampling_params=greedy(2))
    assert engine.generate(prompt="hi", sampling_params=greedy(2)).output_ids


def test_scheduler_rejects_request_over_kv_capacity(engine_factory, llama) -> None:
    engine = engine_factory(llama, max_total_tokens=128)
    with pytest.raises(InvalidRequestError, match="KV cache capacity"):
        engine.generate(input_ids=[11] * 100, sampling_params=greedy(64))
    assert engine.generate(prompt="hi", sampling_params=greedy(2)).output_ids


def test_bad_model_folders(tmp_path, llama) -> None:
    from common.node.engine import Engine

    with pytest.raises(ModelLoadError, match="not a directory"):
        Engine(model_path=str(tmp_path / "missing"))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_weights / name).write_bytes((llama / name).read_bytes())
    with pytest.raises(ModelLoadError, match="safetensors"):
        Engine(model_path=str(no_weights))


def test_the_model_is_built_and_run_on_the_scheduler_thread(engine_factory, llama, monkeypatch) -> None:
    """The caller's thread opens no OpenMP region while the Engine builds (the model's load, its pools): without the
    overlap schedule only the scheduler thread's team exists, so its threads spin between a forward's regions
    instead of sleeping."""
    import threading

    from common.engine.model_runner import ModelRunner

    seen: dict[str, threading.Thread] = {}
    init, forward = ModelRunner.__init__, ModelRunner._forward_and_sample

    def record(name, fn):
        def wrapped(self, *args, **kwargs):
            seen.setdefault(name, threading.current_thread())
            return fn(self, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(ModelRunner, "__init__", record("build", init))
    monkeypatch.setattr(ModelRunner, "_forward_and_sample", record("forward", forward))
    engine = engine_factory(llama, **overlap_flags(False))
    assert engine.generate(input_ids=[11, 12, 13], sampling_params=greedy(2)).output_ids
    assert seen["build"] is seen["forward"] is engine._thread
