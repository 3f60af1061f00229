"""Speculative decoding flags (SGLang's names): what goes together, and what each algorithm drafts per step.

The flags are fields of ``ServerArgs`` (``common.config``); ``check_speculative_flags`` is its check of them, and
``draft_len`` the number of draft tokens a decode step proposes per request. The engine side is
``common.engine.spec``.

Draft length: with ``--speculative-eagle-topk 1`` (linear drafts) a step verifies ``--speculative-num-draft-tokens``
= ``--speculative-num-steps`` + 1 tokens (the last sampled token and its drafts). Give either; both must agree. With
a tree (EAGLE / EAGLE3, topk > 1) the head drafts ``num_steps`` levels of ``topk`` branches and the step verifies
the ``num_draft_tokens`` best nodes (the root included), at most 1 + topk + (num_steps - 1) * topk^2 of them.

Every algorithm works with any ``--tp-size``: a draft model or head is sharded over the target's TP group (the model
loader refuses a size that cannot split it, naming the draft's folder).
"""

from __future__ import annotations

from typing import Any

from common.errors import ConfigError

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")
DRAFT_MODEL_ALGORITHMS = ("STANDALONE", *EAGLE_ALGORITHMS)
DEFAULT_NUM_STEPS = {"NGRAM": 8, "STANDALONE": 3, "EAGLE": 3, "EAGLE3": 3}
DEFAULT_NGRAM_MIN_WINDOW = 2
DEFAULT_NGRAM_MAX_WINDOW = 12
NGRAM_FLAGS = ("speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size")
SPECULATIVE_FLAGS = ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
                     "speculative_num_draft_tokens", *NGRAM_FLAGS)


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_speculative_flags(args: Any) -> None:
    """Raise ``ConfigError`` naming the flag to change when the speculative flags of ``args`` (a ``ServerArgs``) do not
    go together; every speculative flag given either works or is refused here."""
    algo = args.speculative_algorithm
    given = [f for f in SPECULATIVE_FLAGS if getattr(args, f) is not None]
    if algo is None:
        if given:
            raise ConfigError(f"{_option(given[0])} needs --speculative-algorithm ({', '.join(SPECULATIVE_ALGORITHMS)})")
        return
    topk = args.speculative_eagle_topk or 1
    if topk > 1 and algo not in EAGLE_ALGORITHMS:
        raise ConfigError(f"--speculative-eagle-topk {topk}: tree drafts are EAGLE's and EAGLE3's; {algo} drafts "
                          "linearly (use 1 or leave it out)")
    steps, tokens = args.speculative_num_steps, args.speculative_num_draft_tokens
    if topk == 1 and steps is not None and tokens is not None and tokens != steps + 1:
        raise ConfigError(f"--speculative-num-draft-tokens ({tokens}) must be --speculative-num-steps + 1 "
                          f"({steps + 1}) with linear drafts (topk 1): it counts the last sampled token too; "
                          "give one of the two")
    if topk > 1:
        most = tree_candidates(topk, draft_len(args)) + 1
        if tokens is not None and tokens > most:
            raise ConfigError(f"--speculative-num-draft-tokens ({tokens}) exceeds the {most} nodes a tree of "
                              f"--speculative-num-steps {draft_len(args)} and --speculative-eagle-topk {topk} drafts "
                              "(the root included)")
    if algo in DRAFT_MODEL_ALGORITHMS and not args.speculative_draft_model_path:
        what = "model folder with the target's tokenizer" if algo == "STANDALONE" else f"{algo} draft head folder"
        raise ConfigError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path (a local {what})")
    if algo not in DRAFT_MODEL_ALGORITHMS and args.speculative_draft_model_path is not None:
        raise ConfigError(f"--speculative-draft-model-path is for STANDALONE, EAGLE and EAGLE3; {algo} drafts "
                          "without a model")
    stray = [f for f in NGRAM_FLAGS if getattr(args, f) is not None]
    if algo != "NGRAM" and stray:
        raise ConfigError(f"{_option(stray[0])} is for --speculative-algorithm NGRAM, not {algo}")
    low, high = ngram_windows(args)
    if low > high:
        raise ConfigError(f"--speculative-ngram-min-match-window-size ({low}) must be <= "
                          f"--speculative-ngram-max-match-window-size ({high})")
    if args.disaggregation_mode == "prefill" and algo not in DRAFT_MODEL_ALGORITHMS:
        raise ConfigError(f"--speculative-algorithm {algo} speculates decode steps: give it to decode nodes (and "
                          "colocated ones); a prefill node computes only a request's first token (with STANDALONE, "
                          "EAGLE or EAGLE3 it also runs the draft over the prompt, for the decode node's first step)")
    if args.enable_overlap_schedule and args.disaggregation_mode != "prefill":
        node = "a decode" if args.disaggregation_mode == "decode" else "a colocated"
        raise ConfigError(f"--enable-overlap-schedule: {node} node speculates without the overlap schedule (a step's "
                          "drafts need the previous step's accepted tokens, known only once that step ran); drop "
                          "--enable-overlap-schedule (a prefill node takes it with --speculative-algorithm: it "
                          "verifies nothing)")


def draft_len(args: Any) -> int:
    """Draft tokens a step proposes per request (0: speculation off)."""
    algo = args.speculative_algorithm
    if algo is None:
        return 0
    if args.speculative_num_steps is not None:
        return int(args.speculative_num_steps)
    if args.speculative_num_draft_tokens is not None and (args.speculative_eagle_topk or 1) == 1:
        return int(args.speculative_num_draft_tokens) - 1
    return DEFAULT_NUM_STEPS.get(algo, 1)


def tree_candidates(topk: int, num_steps: int) -> int:
    """Draft tokens a tree of ``num_steps`` levels of ``topk`` branches chooses its nodes from."""
    return topk + (num_steps - 1) * topk * topk


def max_draft_tokens(args: Any) -> int:
    """Draft tokens a request's verify holds at most: ``draft_len`` for a chain, ``num_draft_tokens - 1`` for a
    tree (default ``num_steps * topk``)."""
    k, topk = draft_len(args), args.speculative_eagle_topk or 1
    if topk == 1:
        return k
    if args.speculative_num_draft_tokens is not None:
        return int(args.speculative_num_draft_tokens) - 1
    return min(k * topk, tree_candidates(topk, k))


def accept_length(verify_steps: int, accepted_tokens: int) -> float:
    """Tokens a request emitted per verify step (SGLang's accept length: its accepted drafts plus the target's own
    token); 0 without verify steps."""
    return 1.0 + accepted_tokens / verify_steps if verify_steps else 0.0


def ngram_windows(args: Any) -> tuple[int, int]:
    """(shortest, longest) suffix of a request's tokens that NGRAM matches against its earlier tokens."""
    low = args.speculative_ngram_min_match_window_size
    high = args.speculative_ngram_max_match_window_size
    return (DEFAULT_NGRAM_MIN_WINDOW if low is None else low, DEFAULT_NGRAM_MAX_WINDOW if high is None else high)
