"""Workloads: what each request sends. Prompts are token-id lists (exact lengths, no tokenizer needed); chat
turns are text of about the requested length in tokens (one short word is one or two tokens)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("fixed", "random", "mixed", "shared-prefix", "multi-turn")
WORDS = ("the", "a", "cluster", "token", "cache", "page", "router", "node", "decode", "prefill", "batch", "time")


@dataclass(slots=True)
class RequestSpec:
    """One request. ``messages`` set: a chat turn (``/v1/chat/completions``); else ``prompt_ids`` (completions)."""

    index: int
    prompt_ids: list[int]
    max_tokens: int
    kind: str = "short"  # a label for the report: short, long, chat, group<k>
    messages: list[dict[str, str]] | None = None
    group: int | None = None
    priority: int | None = None  # the router's ``priority`` field (nodes with --enable-priority-scheduling)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    kind: str = "fixed"
    num_requests: int = 100
    input_len: int = 128  # fixed; "random": the range is [input_len * (1 - range_ratio), input_len]
    output_len: int = 16
    range_ratio: float = 0.5
    long_input_len: int = 2000  # mixed: the long-context prompts
    long_output_len: int = 8
    long_every: int = 10  # mixed: every k-th request is a long prompt (periodic, not random)
    chat: bool = False  # mixed: the short requests are chat turns
    groups: int = 4  # shared-prefix: number of prefixes; multi-turn: of system prompts
    prefix_len: int = 256  # multi-turn: about this many tokens of system prompt
    turns: int = 4  # multi-turn: user turns per conversation (each request carries the conversation so far)
    token_id_range: tuple[int, int] = field(default=(100, 1500))
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload kind must be one of {KINDS}, got {self.kind!r}")
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_requests, input_len and output_len must be >= 1")
        if not 0 <= self.range_ratio <= 1:
            raise ValueError("range_ratio must be in [0, 1]")
        if self.long_every < 1 or self.groups < 1 or self.turns < 1:
            raise ValueError("long_every, groups and turns must be >= 1")


def _ids(rng: random.Random, n: int, lo_hi: tuple[int, int]) -> list[int]:
    lo, hi = lo_hi
    return [rng.randrange(lo, hi) for _ in range(n)]


def _text(rng: random.Random, n_tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_tokens // 2)))


def _multi_turn(cfg: WorkloadConfig, rng: random.Random) -> list[RequestSpec]:
    """Chat conversations of ``turns`` user turns (about ``input_len`` tokens each, answered by about
    ``output_len`` tokens of assistant text), each opening with one of ``groups`` shared system prompts; a turn's
    request carries the conversation so far. Ordered turn by turn (every conversation's first turn, then every
    second ...), as many users talking at once."""
    systems = [_text(rng, cfg.prefix_len) for _ in range(cfg.groups)]
    convs = [[{"role": "system", "content": rng.choice(systems)}] for _ in range(-(-cfg.num_requests // cfg.turns))]
    out: list[RequestSpec] = []
    for _ in range(cfg.turns):
        for conv in convs:
            if len(out) == cfg.num_requests:
                return out
            conv.append({"role": "user", "content": _text(rng, cfg.input_len)})
            out.append(RequestSpec(len(out), [], cfg.output_len, "chat", messages=list(conv)))
            conv.append({"role": "assistant", "content": _text(rng, cfg.output_len)})
    return out


def make_workload(cfg: WorkloadConfig) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    if cfg.kind == "multi-turn":
        return _multi_turn(cfg, rng)
    ids_range = cfg.token_id_range
    lo_len = max(1, round(cfg.input_len * (1 - cfg.range_ratio)))
    lo_out = max(1, round(cfg.output_len * (1 - cfg.range_ratio)))
    prefixes = [_ids(rng, cfg.prefix_len, ids_range) for _ in range(cfg.groups)]
    out: list[RequestSpec] = []
    for i in range(cfg.num_requests):
        if cfg.kind == "fixed":
            out.append(RequestSpec(i, _ids(rng, cfg.input_len, ids_range), cfg.output_len))
        elif cfg.kind == "random":
            n = rng.randint(lo_len, cfg.input_len)
            out.append(RequestSpec(i, _ids(rng, n, ids_range), rng.randint(lo_out, cfg.output_len)))
        elif cfg.kind == "mixed" and i % cfg.long_every == cfg.long_every - 1:
            out.append(RequestSpec(i, _ids(rng, cfg.long_input_len, ids_range), cfg.long_output_len, "long"))
        elif cfg.kind == "mixed":
            n = rng.randint(lo_len, cfg.input_len)
            if cfg.chat:
                msgs = [{"role": "user", "content": _text(rng, n)}]
                out.append(RequestSpec(i, [], cfg.output_len, "chat", messages=msgs))
            else:
                out.append(RequestSpec(i, _ids(rng, n, ids_range), cfg.output_len, "short"))
        else:
            g = rng.randrange(cfg.groups)
            ids = prefixes[g] + _ids(rng, cfg.input_len, ids_range)
            out.append(RequestSpec(i, ids, cfg.output_len, f"group{g}", group=g))
    return out
