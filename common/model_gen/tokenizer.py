"""Byte-level BPE tokenizer trained offline on the packaged corpus (``corpus.txt``).

Deterministic for a given vocab size (the corpus is a committed data file, not read from the running Python).
Byte-level pre-tokenizer and decoder, no normalizer: any UTF-8 text round-trips through encode/decode.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)  # ids 0..4, in this order

# Qwen2's split pattern (digits one by one). transformers' AutoTokenizer rebuilds qwen2 tokenizers with this pattern
# whatever tokenizer.json says, so using it for every arch keeps tokenizer.json and AutoTokenizer in agreement.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CHAT_TEMPLATE = (
    # Tools (OpenAI ``tools``) as a system turn, Qwen 2.5's way: one JSON definition per line in <tools>.
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a function as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@functools.cache
def train_tokenizer_json(vocab_size: int) -> str:
    """The trained tokenizer serialized as tokenizer.json text (cached per process: training takes ~0.3 s)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    return tok.to_str(pretty=True)


def pad_vocab(tok_json: str, vocab_size: int) -> str:
    """The tokenizer with filler tokens ``<|tN|>`` (N: the id) appended up to ``vocab_size`` ids: no merge makes
    them, so encoding is unchanged, but every id a model of that vocabulary samples decodes to text (an unknown id
    would decode to nothing)."""
    data = json.loads(tok_json)
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    next_id = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))]) + 1
    for i in range(next_id, vocab_size):
        token = f"<|t{i}|>"
        if token in taken:
            raise ValueError(f"filler token {token} is already in the vocabulary")
        vocab[token] = i
    return json.dumps(data, ensure_ascii=False)


def write_tokenizer_files(out_dir: Path, vocab_size: int, max_len: int) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json; return special token ids by name
    (plus ``vocab_size``: the vocabulary's size: ``vocab_size``, with filler tokens past what the corpus trains)."""
    tok_json = train_tokenizer_json(vocab_size)
    if Tokenizer.from_str(tok_json).get_vocab_size() < vocab_size:
        tok_json = pad_vocab(tok_json, vocab_size)
    (out_dir / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    tok = Tokenizer.from_str(tok_json)
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    return {**ids, "vocab_size": tok.get_vocab_size()}


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
