"""``NgramDrafter``: drafts from the request's own prompt and output (prompt lookup), on the host, any device.

The request's last ``n`` tokens (``min_window <= n <= max_window``, the longest match wins, the latest among equals)
are looked up among its earlier tokens; the draft is what followed that earlier occurrence. A continuation that
runs into the current suffix repeats with the match's period (a greedy decode that cycles is drafted whole)::

    tokens:  ... x [a b] c d ...... [a b]      suffix "a b" matched at its earlier end p
    draft:   c d ...                           tokens[p + 1 :], then periodic past the end

Per request (``Req.spec_state``): every token so far and, per ``min_window``-gram, the positions where it ends
(appended as the request grows; built once over the prompt), plus the draft budget. The budget adapts to what the
verify accepts: a fully accepted draft doubles it (up to ``draft_len``), a partly accepted one sets it to twice the
accepted count plus one, and a draft with nothing accepted also pauses drafting, for twice as many steps as after
the previous miss in a row (1, 2, 4, ... ``MAX_PAUSE``), so text the request does not repeat costs few verify steps.

A verify step costs every request of the batch (on CPU about one more decode step), so a step verifies only when
its drafts are expected to add ``VERIFY_COST`` tokens per request of the batch: a request's expected gain is its
draft's length times its acceptance rate (the share of its drafted tokens accepted, averaged over its recent
verifies; 1 before the first). A request whose draft waits for such a step regains ``REGAIN`` of its rate's
distance to 1 each time, so a low rate does not keep it from being tried again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.speculative import ngram_windows

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.model_runner import ModelRunner
    from common.engine.req import Req
    from common.engine.spec.drafter import DraftHandoff

MAX_CANDIDATES = 8  # latest earlier occurrences of the min-window suffix compared for the longest match
MAX_PAUSE = 32  # steps without drafting after consecutive fully rejected drafts (1, 2, 4, ... up to this)
VERIFY_COST = 1.0  # expected accepted tokens per request of the batch that make a verify step worth its cost
REGAIN = 0.05


class _NgramState:
    __slots__ = ("budget", "ends", "misses", "pause", "rate", "tokens")

    def __init__(self, budget: int) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.budget = budget
        self.misses = 0  # consecutive drafts with nothing accepted
        self.pause = 0  # steps left without drafting
        self.rate = 1.0  # accepted / drafted, averaged over its verifies (each new one weighs half)


class NgramDrafter:
    def __init__(self, draft_len: int, min_window: int, max_window: int) -> None:
        self.draft_len = draft_len
        self.min_window = min_window
        self.max_window = max_window

    def propose(self, reqs: list[Req], caps: list[int]) -> list[list[int]]:
        out: list[list[int]] = []
        states = [self._state(r) for r in reqs]
        for state, cap in zip(states, caps, strict=True):
            if state.pause:
                state.pause -= 1
                out.append([])
            else:
                out.append(self.lookup(state, min(cap, state.budget)) if cap else [])
        gain = sum(len(d) * state.rate for d, state in zip(out, states, strict=True))
        if gain >= VERIFY_COST * len(reqs):
            return out
        for d, state in zip(out, states, strict=True):
            if d:
                state.rate += REGAIN * (1.0 - state.rate)
        return [[] for _ in reqs]

    def on_verified(self, req: Req, drafted: int, accepted: int) -> None:
        state = req.spec_state
        state.rate = 0.5 * (state.rate + accepted / drafted)
        if accepted == drafted:
            state.budget = min(self.draft_len, 2 * state.budget)
            state.misses = 0
        else:
            state.budget = min(self.draft_len, 2 * accepted + 1)
            state.misses = 0 if accepted else state.misses + 1
            state.pause = min(1 << (state.misses - 1), MAX_PAUSE) if state.misses else 0

    def release(self, rows: list[int]) -> None:
        """Nothing per slot: the state goes with the request."""

    def close(self) -> None:
        """Nothing built."""

    def handoff(self, row: int) -> None:
        """Nothing crosses P/D: the decode node drafts from the request's tokens."""

    def resume(self, row: int, handoff: DraftHandoff) -> None:
        """Never handed anything (``handoff``)."""

    def _state(self, req: Req) -> _NgramState:
        state = req.spec_state
        if not isinstance(state, _NgramState):
            state = req.spec_state = _NgramState(self.draft_len)
        n_prompt = len(req.origin_input_ids)
        seen = len(state.tokens)
        if seen < n_prompt:
            self._extend(state, req.origin_input_ids[seen:])
            seen = n_prompt
        if seen < n_prompt + len(req.output_ids):
            self._extend(state, req.output_ids[seen - n_prompt :])
        return state

    def _extend(self, state: _NgramState, new: list[int]) -> None:
        tokens, ends, n = state.tokens, state.ends, self.min_window
        for t in new:
            tokens.append(t)
            end = len(tokens) - 1
            if end >= n - 1:
                ends.setdefault(tuple(tokens[end - n + 1 :]), []).append(end)

    def lookup(self, state: _NgramState, k: int) -> list[int]:
        """Up to ``k`` tokens following the longest earlier match of the tokens' suffix (none: no match)."""
        tokens, n = state.tokens, self.min_window
        last = len(tokens) - 1
        if k <= 0 or last < n:
            return []
        candidates = state.ends.get(tuple(tokens[last - n + 1 :]), [])
        best, best_len = -1, 0
        for p in reversed(candidates[-MAX_CANDIDATES - 1 :]):
            if p == last:
                continue
            size = n
            while size < self.max_window and p - size >= 0 and tokens[p - size] == tokens[last - size]:
                size += 1
            if size > best_len:
                best, best_len = p, size
                if size == self.max_window:
                    break
        if best < 0:
            return []
        draft: list[int] = []
        for j in range(k):
            at = best + 1 + j
            draft.append(tokens[at] if at <= last else draft[at - last - 1])
        return draft


def build_drafter(args: ServerArgs, runner: ModelRunner, draft_len: int, dp_rank: int) -> NgramDrafter:
    low, high = ngram_windows(args)
    return NgramDrafter(draft_len, low, high)
