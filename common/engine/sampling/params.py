"""Per-request sampling parameters: the IPC schema (msgspec, frozen) and its validation.

``SamplingParams`` travels front -> scheduler over ZMQ and maps field for field to the protobuf ``SamplingParams``.
msgspec validates types only when decoding; code that builds one directly calls ``verify`` before using it.
"""

from __future__ import annotations

import math

import msgspec

from common.engine.sampling.json_schema import check_schema_depth
from common.errors import InvalidRequestError

# At or below this temperature a request is decoded greedily (dividing logits by it would overflow fp32).
SAMPLING_EPS = 1e-6
MAX_STOP_STRINGS = 32
MAX_STOP_TOKEN_IDS = 1024  # each is checked per output token; a vocabulary's worth of them is never needed
# A stop string's UTF-8 length bounds how many trailing tokens the stop check decodes (see stop.py).
MAX_STOP_STRING_BYTES = 256
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 65536
MAX_LOGIT_BIAS = 1024
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # EOS and stop tokens are masked out (and not honoured) before this many tokens
    temperature: float = 1.0  # 0 (or <= SAMPLING_EPS) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output; 1 = off
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens; 0 = off
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens; 0 = off
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # ignores the model's EOS tokens only; stop_token_ids still stop
    seed: int | None = None  # reproducible per request, whatever the batch (see sampler.py)
    skip_special_tokens: bool = True
    # Constrained decoding (common/engine/sampling/grammar.py): at most one; every sampled token keeps the output a prefix
    # of the language, and the request stops when the grammar is complete.
    json_schema: str | None = None  # a JSON Schema, as JSON text; '{"type": "object"}' is JSON-object mode
    regex: str | None = None
    ebnf: str | None = None  # GBNF-style EBNF with a ``root`` rule
    # Added to the named tokens' logits before sampling (after penalties, before a grammar's mask); OpenAI's
    # semantics: [-100, 100], where +-100 in practice forces or bans the token.
    logit_bias: dict[int, float] | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= SAMPLING_EPS or self.top_k == 1

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """``(kind, source)`` of the request's grammar, or None: the compiled-grammar cache's key."""
        for kind in GRAMMAR_KINDS:
            source = getattr(self, kind)
            if source is not None:
                return kind, source
        return None

    @property
    def has_penalty(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ``InvalidRequestError`` naming the first invalid field and the accepted range."""
        for name in ("max_new_tokens", "min_new_tokens", "top_k"):
            _require_int(name, getattr(self, name))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            _require_number(name, getattr(self, name))

        if self.max_new_tokens < 0:
            _fail(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            _fail(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            _fail(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            _fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            _fail(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            _fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            _fail(f"repetition_penalty must be > 0 (1.0 is off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                _fail(f"{name} must be in [-2, 2] (0 is off), got {value}")
        self._verify_stop(vocab_size)
        self._verify_grammar()
        self._verify_logit_bias(vocab_size)
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not _INT64_MIN <= self.seed <= _INT64_MAX:
                _fail(f"seed must fit in a signed 64-bit integer, got {self.seed}")

    def _verify_stop(self, vocab_size: int | None) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str):
                _fail(f"stop must contain strings, got {type(s).__name__} {s!r}")
            if not s:
                _fail("stop must not contain an empty string (it would match immediately); remove it")
            if len(s.encode("utf-8")) > MAX_STOP_STRING_BYTES:
                _fail(
                    f"stop strings must be at most {MAX_STOP_STRING_BYTES} bytes in UTF-8, got {s[:32]!r}..."
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail(f"stop_token_ids accepts at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        bound = "vocab_size" if vocab_size is None else f"vocab_size={vocab_size}"
        for t in self.stop_token_ids:
            _require_int("stop_token_ids", t)
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                _fail(f"stop_token_ids must be token ids in [0, {bound}), got {t}")


    def _verify_logit_bias(self, vocab_size: int | None) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            _fail(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            _fail(f"logit_bias accepts at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        bound = "vocab_size" if vocab_size is None else f"vocab_size={vocab_size}"
        for token, bias in self.logit_bias.items():
            _require_int("logit_bias token id", token)
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                _fail(f"logit_bias keys must be token ids in [0, {bound}), got {token}")
            _require_number(f"logit_bias[{token}]", bias)
            if not -100 <= bias <= 100:
                _fail(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

    def _verify_grammar(self) -> None:
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            _fail(f"at most one of json_schema, regex, ebnf may be set, got {' and '.join(given)}")
        for kind in given:
            source = getattr(self, kind)
            if not isinstance(source, str):
                _fail(f"{kind} must be a string, got {type(source).__name__}")
            if not source:
                _fail(f"{kind} must not be empty")
            if len(source) > MAX_GRAMMAR_CHARS:
                _fail(f"{kind} must be at most {MAX_GRAMMAR_CHARS} characters, got {len(source)}")
        if self.json_schema is not None:
            check_schema_depth(self.json_schema)


def for_choice(sp: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i`` of an ``n > 1`` request: a seeded request samples with seed + i (wrapped to a signed 64-bit
    integer), so the choices differ and each is reproducible; an unseeded one is unchanged."""
    if sp.seed is None:
        return sp
    return msgspec.structs.replace(sp, seed=(sp.seed + i + (1 << 63)) % (1 << 64) - (1 << 63))


def _fail(message: str) -> None:
    raise InvalidRequestError(message)


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(f"{name} must be an integer, got {type(value).__name__} {value!r}")


def _require_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        _fail(f"{name} must be a finite number, got {value!r}")
