"""Batched next-token sampling: ``SamplingBatchInfo`` (per-batch sampling state) and ``Sampler``.

Per step, for logits ``[bs, vocab]`` fp32::

    raw logits ──> logprobs (log_softmax of the RAW logits, when any row asks)
        └──> penalties (repetition, frequency/presence, min_new_tokens) ──> logit_bias ──> grammar mask
                 ──> argmax ............................................................... greedy rows
                 └──> / temperature ─> softmax ─> top-k ─> top-p ─> min-p ─> inverse-CDF draw ... sampled rows

- Greedy rows take ``argmax`` of the penalised logits; with no penalty in the batch that is exactly
  ``argmax(raw logits)`` (no softmax, no noise), the same tie-breaking as HF ``generate``.
- top-k, top-p and min-p truncate the distribution in turn, each on the renormalised result of the previous one
  (HF warper semantics; min-p is invariant to renormalisation).
- The draw walks the probabilities sorted descending, ties in token-id order (a stable sort). When every sampled row
  has a top-k of at most vocab / ``FAST_TOP_K_RATIO`` (CPU), only the first ``max(top_k)`` of that order are built
  (``top_k_sorted``: one ``topk`` over the vocab and sorts of k columns, unless values tie at the k-th); every later
  step (top-p, min-p, the CDF) then runs on those k columns. The columns past the k-th hold zeros in the full order, and CPU
  cumsum is sequential, so both give the same token for every ``u``. A batch with no top-k first tries
  ``draw_in_window`` (the ``SORT_WINDOW`` most likely tokens), which answers only when it can prove the same token.
- Logprobs are of the model's distribution (raw logits, before penalties and temperature), what OpenAI clients
  expect. SGLang returns post-temperature logprobs by default; we deliberately do not.

Randomness: each sampled row consumes exactly one uniform ``u`` per step. A row with ``seed`` derives
``u = hash(seed, step)`` where ``step = len(output_ids)`` before the draw (plus ``prior_output_len`` for a migrated
request), so its tokens do not depend on batch composition, position in the batch, device, retraction, which node
(prefill or decode) draws the token, or a migration.
Unseeded rows take ``u`` from one generator shared by the ``Sampler``.

Lifecycle (owned by the scheduler): ``from_reqs`` when a batch is built; after each step whose tokens are appended
to every row, ``cumulate_output_tokens(next_ids)`` exactly once; ``filter_batch`` / ``merge_batch`` mirror the
batch's own. The incremental state always equals ``from_reqs`` rebuilt on the same requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from common.engine.device import ship
from common.engine.sampling.grammar import allocate_bitmask, apply_bitmask
from common.engine.sampling.penalties import PenaltyState
from common.engine.sampling.sample_output import SampleOutput

if TYPE_CHECKING:
    from common.engine.req import Req
    from common.engine.sampling.params import SamplingParams

_MASK64 = (1 << 64) - 1
# A batch draws through ``top_k_sorted`` when max(top_k) * FAST_TOP_K_RATIO <= vocab: on CPU, topk + sorts of k
# beat the full stable sort up to k ~ vocab / 16, so the ratio keeps a margin (benchmarks/pages/engine_throughput.md).
FAST_TOP_K_RATIO = 32
# A batch with no top-k (CPU, vocab >= SORT_WINDOW * FAST_TOP_K_RATIO) first looks for its tokens among the
# SORT_WINDOW most likely ones (``draw_in_window``) and sorts the vocab only when that cannot prove the answer.
SORT_WINDOW = 256


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) that a request with ``seed`` draws for its ``step``-th output token."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ step) >> 11) * 2.0**-53


# What ``_build_param_columns`` derives from a batch's params alone. A decode batch keeps its requests step after
# step, so the last batch's columns (keyed by the identity of its params, in order) are reused as they are: they are
# never written in place.
_PARAM_COLUMNS = ("sampled_rows", "all_greedy", "need_top_k", "sort_width", "window_width", "need_top_p",
                  "need_min_p", "seeds", "sampled_index", "top_ks", "temperatures", "top_ps", "min_ps")
_param_columns: tuple[tuple[object, ...], list[SamplingParams], dict[str, object]] | None = None


class SamplingBatchInfo:
    """Sampling state of one batch; row ``i`` is the batch's request ``i``."""

    def __init__(
        self,
        params: list[SamplingParams],
        output_lens: list[int],
        return_logprob: list[bool],
        top_logprobs_nums: list[int],
        penalties: PenaltyState,
        vocab_size: int,
        device: torch.device,
        grammar_rows: list[int] | None = None,
        grammar_bitmask: torch.Tensor | None = None,
        logit_bias: list[tuple[int, int, float]] | None = None,
    ) -> None:
        self.params = params
        self.output_lens = output_lens  # tokens each row has produced = the step index of its next draw
        self.return_logprob = return_logprob
        self.top_logprobs_nums = top_logprobs_nums
        self.penalties = penalties
        self.vocab_size = vocab_size
        self.device = device
        # This step's grammar masks (a step's, never carried over): rows ``grammar_rows`` of the batch, one packed
        # bitmask row each (xgrammar's layout: bit t of word t // 32 set = token t allowed).
        self.grammar_rows = grammar_rows or []
        self.grammar_index: torch.Tensor | None = None
        self.grammar_bitmask: torch.Tensor | None = None
        if grammar_bitmask is not None and self.grammar_rows:
            index, flat = ship([torch.tensor(self.grammar_rows, dtype=torch.int32), grammar_bitmask.view(-1)],
                               device)
            self.grammar_index, self.grammar_bitmask = index.long(), flat.view(grammar_bitmask.shape)
        # This step's logit biases (row, token, bias), as three device columns; None when no row has one.
        self.logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if logit_bias:
            rows, cols, vals = ship([torch.tensor(c, dtype=torch.float64) for c in zip(*logit_bias, strict=True)],
                                    device)
            self.logit_bias = (rows.long(), cols.long(), vals.float())
        self._build_tensors()

    @classmethod
    def from_reqs(cls, reqs: Sequence[Req], vocab_size: int, device: torch.device | str) -> SamplingBatchInfo:
        device = torch.device(device)
        grammar_rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        bias = [(i, t, b) for i, r in enumerate(reqs) for t, b in (r.sampling_params.logit_bias or {}).items()]
        bitmask = None
        if grammar_rows:
            bitmask = allocate_bitmask(len(grammar_rows), vocab_size)
            for j, i in enumerate(grammar_rows):
                reqs[i].grammar.fill_bitmask(bitmask, j)
        return cls(
            logit_bias=bias,
            grammar_rows=grammar_rows,
            grammar_bitmask=bitmask,
            params=[r.sampling_params for r in reqs],
            output_lens=[r.draw_step() for r in reqs],
            return_logprob=[r.return_logprob for r in reqs],
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in reqs],
            penalties=PenaltyState.from_reqs(reqs, vocab_size, device),
            vocab_size=vocab_size,
            device=device,
        )

    def _build_tensors(self) -> None:
        """Derive tensors and flags from the Python-side lists (O(bs), one host-to-device copy in all)."""
        self.need_logprobs = any(self.return_logprob)
        self.max_top_logprobs = max(self.top_logprobs_nums, default=0)
        key = (self.device, self.vocab_size, FAST_TOP_K_RATIO, SORT_WINDOW, tuple(map(id, self.params)))
        cached = _param_columns
        if cached is not None and cached[0] == key:
            self.__dict__.update(cached[2])
            return
        self._build_param_columns()
        # NOTE: the entry holds the params list: while cached, no id in its key can name another object
        globals()["_param_columns"] = (key, self.params, {k: getattr(self, k) for k in _PARAM_COLUMNS})

    def _build_param_columns(self) -> None:
        vocab, params = self.vocab_size, self.params
        greedy = [p.is_greedy for p in params]
        self.sampled_rows = [i for i, g in enumerate(greedy) if not g]
        sampled = [params[i] for i in self.sampled_rows]
        top_ks = [vocab if p.top_k == -1 else min(p.top_k, vocab) for p in sampled]
        self.all_greedy = not sampled
        self.need_top_k = any(k < vocab for k in top_ks)
        # Columns of the sorted distribution the draw needs: max(top_k), or the whole vocab (full sort).
        max_k = max(top_ks, default=vocab)
        fast = self.need_top_k and self.device.type == "cpu" and max_k * FAST_TOP_K_RATIO <= vocab
        self.sort_width = max_k if fast else vocab
        on_cpu = self.device.type == "cpu"
        window = bool(sampled) and not self.need_top_k and on_cpu and vocab >= SORT_WINDOW * FAST_TOP_K_RATIO
        self.window_width = SORT_WINDOW if window else 0
        self.need_top_p = any(p.top_p < 1.0 for p in sampled)
        self.need_min_p = any(p.min_p > 0.0 for p in sampled)
        self.seeds = [p.seed for p in sampled]  # per sampled row
        # Tensors below cover the sampled rows only, in ``sampled_rows`` order. They travel as one float64
        # buffer (exact for these ints and for float32 values) and are cast back on the device.
        f64 = torch.float64
        host = [
            torch.tensor(self.sampled_rows, dtype=f64),
            torch.tensor(top_ks, dtype=f64),
            torch.tensor([p.temperature for p in sampled], dtype=f64),
            torch.tensor([p.top_p for p in sampled], dtype=f64),
            torch.tensor([p.min_p for p in sampled], dtype=f64),
        ]
        index, ks, temps, top_ps, min_ps = ship(host, self.device)
        self.sampled_index, self.top_ks = index.to(torch.int64), ks.to(torch.int64)
        self.temperatures, self.top_ps, self.min_ps = temps.float(), top_ps.float(), min_ps.float()

    def __len__(self) -> int:
        return len(self.params)

    def cumulate_output_tokens(self, next_ids: torch.Tensor) -> None:
        """Record the token appended to every row this step (int64 ``[bs]``)."""
        self.penalties.cumulate_output_tokens(next_ids.to(self.device))
        self.output_lens = [n + 1 for n in self.output_lens]

    def filter_batch(self, keep_indices: list[int]) -> None:
        """Keep rows ``keep_indices`` in that order (the batch dropped the others)."""
        self.params = [self.params[i] for i in keep_indices]
        self.output_lens = [self.output_lens[i] for i in keep_indices]
        self.return_logprob = [self.return_logprob[i] for i in keep_indices]
        self.top_logprobs_nums = [self.top_logprobs_nums[i] for i in keep_indices]
        self.penalties.filter(keep_indices)
        self.grammar_rows, self.grammar_index, self.grammar_bitmask = [], None, None  # masks are per step
        self.logit_bias = None
        self._build_tensors()

    def merge_batch(self, other: SamplingBatchInfo) -> None:
        """Append ``other``'s rows after ours (the batch absorbed ``other``'s requests)."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge batches of vocab {self.vocab_size} and {other.vocab_size}")
        self.params = self.params + other.params
        self.output_lens = self.output_lens + other.output_lens
        self.return_logprob = self.return_logprob + other.return_logprob
        self.top_logprobs_nums = self.top_logprobs_nums + other.top_logprobs_nums
        self.penalties.merge(other.penalties)
        self.grammar_rows, self.grammar_index, self.grammar_bitmask = [], None, None  # masks are per step
        self.logit_bias = None
        self._build_tensors()


def top_k_sorted(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs.sort(dim=-1, descending=True, stable=True)`` cut to its first ``k`` columns.

    One ``topk(k + 1)`` over the vocab: when no row's k-th value ties its (k+1)-th, those k columns are exactly the
    first k of the stable order, which sorting them by id and then stably by value restores. A row with such a tie
    (the stable order keeps the LOWEST tied ids, ``topk`` any of them) or a NaN sends the batch through the full sort.
    """
    if k < probs.shape[1]:
        vals, ids = probs.topk(k + 1, dim=-1)
        if bool((vals[:, k - 1] > vals[:, k]).all()):
            ids = ids[:, :k].sort(dim=-1).values
            vals, pos = probs.gather(1, ids).sort(dim=-1, descending=True, stable=True)
            return vals, ids.gather(1, pos)
    vals, ids = probs.sort(dim=-1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


def draw_in_window(probs: torch.Tensor, info: SamplingBatchInfo, u: torch.Tensor, w: int) -> torch.Tensor | None:
    """The tokens the full-sort draw picks (no row has a top-k), found among each row's ``w`` most likely tokens; None
    when that cannot be proved for every row (the caller then sorts the vocab).

    Proved when the window is exactly the first w of the stable order (no tie at the w-th value), the full order's
    total mass is known to the bit (below), and per row either rank w-1 is truncated by top-p or min-p (then every
    later rank is too: its mass-before and its probability are monotone in rank) or the row truncates nothing and
    its target lies below the window's mass.
    """
    vals, ids = probs.topk(w + 1, dim=-1)
    if not bool((vals[:, w - 1] > vals[:, w]).all()):
        return None
    ids = ids[:, :w].sort(dim=-1).values
    p, pos = probs.gather(1, ids).sort(dim=-1, descending=True, stable=True)
    order = ids.gather(1, pos)
    # NOTE: the full path's total is the fp32 rounding of a sequential float64 sum (CPU cumsum accumulates in
    # double); any-order float64 sums lie within vocab * 2^-52 of it, so when that interval rounds to one fp32
    # value, it is the full path's total.
    exact = probs.double().sum(dim=-1)
    err = exact * (probs.shape[1] * 2.0**-52)
    total = (exact - err).float()
    if not torch.equal(total, (exact + err).float()):
        return None
    if info.need_top_p:
        p = p.masked_fill(p.cumsum(dim=-1) - p > info.top_ps.unsqueeze(1) * total.unsqueeze(1), 0.0)
    if info.need_min_p:
        p = p.masked_fill(p < p[:, :1] * info.min_ps.unsqueeze(1), 0.0)
    cdf = p.cumsum(dim=-1)
    cut = p[:, -1] == 0  # rank w-1 has p > 0 (it beats rank w), so 0 means truncated
    untruncated = (info.top_ps >= 1.0) & (info.min_ps <= 0.0)
    target = u * torch.where(cut, cdf[:, -1], total)
    pos = torch.searchsorted(cdf, target.unsqueeze(1), right=True)
    if not bool((cut | (untruncated & (pos.squeeze(1) < w))).all()):
        return None
    pos = torch.minimum(pos, (p > 0).sum(dim=-1, keepdim=True) - 1)
    return order.gather(1, pos).squeeze(1)


class Sampler:
    """Stateless over requests; owns only the generator shared by unseeded rows."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed if seed is not None else int(torch.randint(0, 2**62, ()).item())
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        if logits.shape != (len(info), info.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} != (bs={len(info)}, vocab={info.vocab_size})"
            )
        logits = logits.float()
        logprobs, top_vals, top_ids = self._logprobs(logits, info) if info.need_logprobs else (None, None, None)
        scores = info.penalties.apply(logits) if info.penalties.is_active else logits
        if info.logit_bias is not None:
            rows, cols, vals = info.logit_bias
            scores = scores.index_put((rows, cols), vals, accumulate=True)
        if info.grammar_bitmask is not None and info.grammar_index is not None:
            scores = apply_bitmask(scores, info.grammar_bitmask, info.grammar_index, info.vocab_size)
        next_ids = torch.argmax(scores, dim=-1)
        if not info.all_greedy:
            rows = info.sampled_index
            next_ids[rows] = self._sample(scores[rows], info)
        if logprobs is not None:
            logprobs = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        return SampleOutput(next_ids, logprobs, top_ids, top_vals, list(info.top_logprobs_nums))

    def _sample(self, scores: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Draw one token per sampled row from ``scores`` ``[n, vocab]`` (penalised logits)."""
        probs = torch.softmax(scores / info.temperatures.unsqueeze(1), dim=-1)
        u = self._uniforms(info, probs.device)
        if info.window_width:
            ids = draw_in_window(probs, info, u, info.window_width)
            if ids is not None:
                return ids
        # Stable descending sort: equal probabilities keep token-id order, so the draw is deterministic.
        if info.sort_width < info.vocab_size:
            probs, order = top_k_sorted(probs, info.sort_width)
        else:
            probs, order = probs.sort(dim=-1, descending=True, stable=True)
        if info.need_top_k:
            ranks = torch.arange(probs.shape[1], device=probs.device)
            probs = probs.masked_fill(ranks >= info.top_ks.unsqueeze(1), 0.0)
        if info.need_top_p:
            cum = probs.cumsum(dim=-1)
            # Drop a token when the kept mass before it already exceeds top_p; rank 0 is always kept.
            probs = probs.masked_fill(cum - probs > info.top_ps.unsqueeze(1) * cum[:, -1:], 0.0)
        if info.need_min_p:
            probs = probs.masked_fill(probs < probs[:, :1] * info.min_ps.unsqueeze(1), 0.0)
        cdf = probs.cumsum(dim=-1)
        target = u * cdf[:, -1]
        pos = torch.searchsorted(cdf, target.unsqueeze(1), right=True)
        # u * total can round up to total; the last kept rank is the right answer then.
        pos = torch.minimum(pos, (probs > 0).sum(dim=-1, keepdim=True) - 1)
        return order.gather(1, pos).squeeze(1)

    def _uniforms(self, info: SamplingBatchInfo, device: torch.device) -> torch.Tensor:
        """One uniform per sampled row: ``seeded_uniform`` for seeded rows, the shared generator otherwise."""
        n = len(info.seeds)
        seeded = [(i, s) for i, s in enumerate(info.seeds) if s is not None]
        vals = [seeded_uniform(s, info.output_lens[info.sampled_rows[i]]) for i, s in seeded]
        if len(seeded) == n:
            return ship([torch.tensor(vals, dtype=torch.float32)], device)[0]
        u_shared = torch.rand(n, generator=self._generator(device), device=device)
        if seeded:
            # float64 carries the row indices exactly and the float32 uniforms unchanged: one copy for both.
            idx, u = ship([torch.tensor([i for i, _ in seeded], dtype=torch.float64),
                           torch.tensor(vals, dtype=torch.float64)], device)
            u_shared[idx.to(torch.int64)] = u.float()
        return u_shared

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, info: SamplingBatchInfo
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-softmax of the raw logits, and the top ``max_top_logprobs`` values and ids (on the device)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        if info.max_top_logprobs == 0:
            return logprobs, None, None
        k = min(info.max_top_logprobs, info.vocab_size)
        vals, ids = logprobs.topk(k, dim=-1)
        return logprobs, vals, ids
