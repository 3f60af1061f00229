"""``FastTokenizer`` (tokenizers + jinja2, no transformers) against transformers' ``AutoTokenizer``, the oracle:
token ids, decoded text (whole, incremental, special tokens skipped or kept), chat-template text, special tokens,
on the tiny models of every supported architecture and on folders edited to reach the loader's other branches."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from common.text.detokenizer import IncrementalDetokenizer
from common.text.fast_tokenizer import FastTokenizer, load_fast_tokenizer
from common.text.tokenizer import load_tokenizer
from tests.model_fixtures import make_tiny_model

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
TEXTS = (
    "Hello, world!",
    "  leading and trailing spaces  \n\n\ttabs",
    "caf\u00e9 vs cafe\u0301 (NFC and NFD), \u212b, \ufb01",  # AutoTokenizer normalises qwen2 input to NFC
    "digits 1234567890 and 3.14159",
    "\u4f60\u597d\uff0c\u4e16\u754c \U0001f600\U0001f44d\U0001f3fd emoji",
    "<|im_start|>user\nspecial tokens inline<|im_end|></s><s><pad>",
    "it's we'll they'd I'M",
    "",
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi \U0001f642 caf\u00e9", "name": None},  # None-valued keys are dropped
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "And now?"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "M\u00e9t\u00e9o <b>now</b>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _pair(path: Path) -> tuple[FastTokenizer, Any]:
    fast = load_fast_tokenizer(path)
    assert fast is not None, f"{path}: the tokenizers-only loader refused a folder it covers"
    return fast, AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def assert_same(fast: FastTokenizer, hf: Any) -> None:
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
    rng = random.Random(0)
    n = len(hf)
    assert len(fast) == n and fast.get_vocab() == hf.get_vocab()
    seqs = [_ids(rng, k, n) for k in (1, 2, 7, 40) for _ in range(25)] + [hf.encode(t) for t in TEXTS]
    for ids in seqs:
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    for ids in seqs[-len(TEXTS):] + seqs[:20]:  # streaming: the same deltas, token by token
        for skip in (True, False):
            a, b = IncrementalDetokenizer(fast, skip), IncrementalDetokenizer(hf, skip)
            assert [a.add([t]) for t in ids] + [a.add([], final=True)] == [b.add([t]) for t in ids] + [
                b.add([], final=True)]
    assert fast.special_tokens_map == hf.special_tokens_map
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert (getattr(fast, name), getattr(fast, f"{name}_id")) == (getattr(hf, name), getattr(hf, f"{name}_id"))
    assert fast.chat_template == hf.chat_template
    if hf.chat_template is None:
        return
    for gen in (True, False):
        for tools in (None, TOOLS):
            kw: dict[str, Any] = {"tools": tools, "add_generation_prompt": gen}
            text = fast.apply_chat_template(MESSAGES, tokenize=False, **kw)
            assert text == hf.apply_chat_template(MESSAGES, tokenize=False, **kw)
            assert fast.apply_chat_template(MESSAGES, tokenize=True, **kw) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_tokenize_as_transformers(arch: str) -> None:
    fast, hf = _pair(make_tiny_model(arch))
    assert_same(fast, hf)
    assert type(load_tokenizer(make_tiny_model(arch))) is FastTokenizer


def _edited(tmp_path: Path, arch: str, config: dict[str, Any] | None = None,
            tokenizer: dict[str, Any] | None = None, files: dict[str, str] | None = None) -> Path:
    path = tmp_path / arch
    shutil.copytree(make_tiny_model(arch), path)
    for name, edit in (("tokenizer_config.json", config), ("tokenizer.json", tokenizer)):
        if edit:
            data = json.loads((path / name).read_text())
            data.update(edit)
            (path / name).write_text(json.dumps(data))
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_text(text)
    return path


# A template that reads what the shipped one does not: a None-valued key, tojson with non-ASCII, a namespace,
# loop controls, the special-token variables and the {% generation %} tag.
RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% generation %}A: {{ m.content }}{% endgeneration %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "{% if m.name is defined %}[{{ m.name }}]{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{{ tools | tojson(indent=2) }}{% endif %}#{{ ns.n }}{{ eos_token }}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


@pytest.mark.parametrize(
    "arch,config,tokenizer,files",
    [
        ("llama", {"chat_template": RICH_TEMPLATE}, None, None),
        ("qwen2", {"chat_template": RICH_TEMPLATE}, None, None),
        ("llama", None, None, {"chat_template.jinja": RICH_TEMPLATE}),  # the file wins over tokenizer_config
        ("llama", {"chat_template": [{"name": "default", "template": RICH_TEMPLATE},
                                     {"name": "tool_use", "template": RICH_TEMPLATE + "tools!"}]}, None, None),
        ("llama", {"add_bos_token": True, "add_eos_token": True}, None, None),  # ignored beside tokenizer.json
        ("llama", None, {"post_processor": {"type": "TemplateProcessing", "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}}}, None),  # BOS added
        ("qwen3", {"tokenizer_class": "Qwen2Tokenizer"}, None, None),  # Qwen2's rebuild, NFC included
        ("mistral", {"clean_up_tokenization_spaces": True}, None, None),  # transformers skips it for BPE
    ],
)
def test_edited_folders_tokenize_as_transformers(tmp_path: Path, arch: str, config: dict[str, Any] | None,
                                                  tokenizer: dict[str, Any] | None, files: dict[str, str] | None
                                                  ) -> None:
    assert_same(*_pair(_edited(tmp_path, arch, config, tokenizer, files)))


def test_template_errors_are_the_same(tmp_path: Path) -> None:
    fast, hf = _pair(_edited(tmp_path, "llama", {"chat_template": "{{ raise_exception('no system role') }}"}))
    for tok in (fast, hf):
        with pytest.raises(Exception, match="no system role"):
            tok.apply_chat_template(MESSAGES, tokenize=False)
        with pytest.raises(ValueError, match="empty conversation"):
            tok.apply_chat_template([], tokenize=False)


@pytest.mark.parametrize(
    "config,files,why",
    [
        ({"tokenizer_class": "LlamaTokenizerFast"}, None, "a class transformers rebuilds its own way"),
        ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, None, "remote code"),
        (None, {"special_tokens_map.json": json.dumps({"eos_token": "<|not-in-vocab|>"})},
         "a special token tokenizer.json lacks"),
        ({"image_token": "<image>"}, None, "a model-specific special token"),
        (None, {"tekken.json": "{}"}, "Mistral's own tokenizer files"),
    ],
)
def test_folders_it_does_not_cover_load_through_transformers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, config: dict[str, Any] | None, files: dict[str, str] | None,
    why: str,
) -> None:
    path = _edited(tmp_path, "llama", config, None, files)
    assert load_fast_tokenizer(path) is None, why
    with caplog.at_level(logging.WARNING, logger="common.text.tokenizer"):
        tok = load_tokenizer(path)
    assert not isinstance(tok, FastTokenizer)
    assert "loading the tokenizer through transformers" in caplog.text


def test_grammar_reads_the_transformers_tokenizer_on_first_use() -> None:
    fast = load_fast_tokenizer(make_tiny_model("llama"))
    assert fast is not None
    hf = fast.transformers_tokenizer()
    assert hf is fast.transformers_tokenizer() and hf.encode("Hello") == fast.encode("Hello")


def test_a_streamed_token_seen_before_is_decoded_once() -> None:
    """The detokenizer memoizes a token's text alone in the tokenizer (``token_texts``): a token another stream
    already read costs one decode, the window with it; two without the memo."""
    fast = load_fast_tokenizer(make_tiny_model("llama"))
    assert fast is not None
    calls: list[int] = []
    decode = fast.decode

    def counting(ids: list[int] | int, skip_special_tokens: bool = False) -> str:
        calls.append(1)
        return decode(ids, skip_special_tokens=skip_special_tokens)

    fast.decode = counting  # type: ignore[method-assign]
    ids = fast.encode("plain ascii words, streamed one token at a time, none of them split over two tokens")
    first = [IncrementalDetokenizer(fast, True).add([t]) for t in ids]
    calls.clear()
    again = IncrementalDetokenizer(fast, True)
    assert [again.add([t]) for t in ids] == first
    assert len(calls) <= len(ids)
