"""``StandaloneDrafter``: a smaller model with the target's tokenizer drafts ``k`` tokens greedily, over a paged KV
pool of its own (a second ``ModelRunner``: its own allocator, KV pool and ``req_to_token`` table). Its decode steps
and its decode-time extends (``draft_extend_graph_runner``) run as CUDA graphs / compiled
steps under the target's flags; its prefill-time extends (a prompt, a P/D prefill chunk) eagerly.

The draft's table is indexed by the target's request slots: row r holds the draft KV of the request in target slot
r, valid for its first ``draft_lens[r]`` positions. Per step, for each request with a cap (``propose``)::

    sync:       draft_lens[r] = min(draft_lens[r], kv_committed_len)   the verify kept the target KV of exactly the
                (pages wholly past it freed)                           tokens the draft fed at those positions
    extend:     one DRAFT_EXTEND forward over all_ids()[draft_lens[r]:] (its last token, plus whatever the draft
                has not seen: the whole prompt on its first step, the accepted drafts' last one after a full accept)
                -> d1 = argmax at the last position
    decode:     k - 1 DECODE forwards feeding d_j -> d_(j+1)
    afterwards: draft_lens[r] = seqlen + k - 1 (positions of last, d1 .. d_(k-1))

On a colocated node the draft needs no prefill of its own: after a chunked prefill or a radix hit and after a
retraction alike, its first step extends over the prompt (the draft model is small: that costs a fraction of the
target's prefill). Its KV goes with the request's slot: ``release`` (the target pool's ``on_free``) frees a row's
pages at once. The draft pool holds the target's token count plus ``k`` pages of headroom per request slot; a step
whose draft KV does not fit drafts nothing (plain decode).

P/D nodes (prefill and decode) keep the draft KV of committed positions at the target's slots, so it travels with
the target's pages and is covered by the target's allocation, prefix caches and frees, as EAGLE's head KV is::

    draft pool slots:  [ page 0 | pages 1 .. T: the target's numbering (mirror) | own pages: the headroom ]

    after every target prefill forward (``after_forward``, each prefill row of an EXTEND / MIXED batch): the draft
        extends over the chunk at the target's slots; row r := the target's row, draft_lens[r] = seq
    prefill node: ``handoff`` tells the decode node the draft KV of the whole prompt came with the pages (the hook
        runs on the forward thread in launch order; ``handoff`` reads ``draft_lens`` once that forward's result was
        obtained, so the overlap schedule sends what an inline node sends)
    decode node: ``resume`` on landing: row r := the target's row over the prompt, draft_lens[r] = prompt length,
        so the first decode step extends the draft over one token, not the prompt
    propose: positions past the target's committed ones fill the rest of the request's last target page (the
        slots the target gives them next) and then own pages (the headroom); ``_sync`` copies the draft KV of
        newly committed positions from own pages to the target's slots and frees every own page of the row; an
        extend over committed positions the draft has not seen writes them at the target's slots too

A prefix the target's cache holds was computed by a prefill forward on this node (the hook ran), landed from a
prefill node holding the same draft (the handshake's fingerprint), or came back from the hierarchical cache's host
or storage tier, whose pages hold the draft's layers beside the target's (``hicache.host_pool``; the storage key
covers the draft), so its draft KV is in place. A decode node's retraction copies a request's pages to the host
tier between steps, when ``on_verified`` has moved every committed position's draft KV to the target's slots.

Tensor parallelism: the draft is sharded over the target's ``TPGroup`` (SGLang shards it with the target's tp):
each rank holds the draft's shard and a pool of its KV heads, the pool's size agreed over the group as the
target's is. Every rank runs the same draft forwards on the same inputs (the scheduler's state is the same on
every rank) and gets the same gathered logits, so every rank drafts the same tokens for the verify forward.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.engine.forward_batch import ForwardMode
from common.engine.mem.allocator import TokenToKVPoolAllocator
from common.engine.model_runner import ModelRunner
from common.engine.sampling.params import SamplingParams
from common.engine.sampling.sampler import SamplingBatchInfo
from common.engine.schedule_batch import ModelWorkerBatch
from common.engine.spec.draft_extend_graph_runner import build_draft_extend_graph_runner
from common.engine.spec.drafter import DraftHandoff, DraftKV
from common.engine.spec.path_kv import compact_path_kv
from common.errors import ConfigError

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.forward_batch import ForwardBatch
    from common.engine.req import Req

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(max_new_tokens=1, temperature=0.0)


class _GreedyRow:
    """A sampling row that takes the argmax (``SamplingBatchInfo.from_reqs`` reads it as a request)."""

    sampling_params = _GREEDY
    grammar = None
    return_logprob = False
    top_logprobs_num = 0
    origin_input_ids: list[int] = []
    output_ids: list[int] = []
    eos_token_ids: frozenset[int] = frozenset()

    def draw_step(self) -> int:
        return 0

    def generated_ids(self) -> list[int]:
        return []


class StandaloneDrafter:
    def __init__(self, args: ServerArgs, target: ModelRunner, draft_len: int, dp_rank: int = 0) -> None:
        path = args.speculative_draft_model_path
        assert path is not None
        ps, slots = args.page_size, target.req_to_token_pool.size
        headroom = slots * (-(-draft_len // ps) + 1) * ps
        # Its decode steps replay graphs / compiled steps as the target's do (the same flags).
        draft_args = args.replace(max_total_tokens=target.max_total_num_tokens + headroom)
        # Sharded over the target's TP group (raises ConfigError naming the draft when --tp-size cannot split it).
        self.runner = ModelRunner(draft_args, path, dp_rank, tp=target.tp)
        cfg, tcfg = self.runner.model_config, target.model_config
        if cfg.vocab_size != tcfg.vocab_size:
            raise ConfigError(f"--speculative-draft-model-path {path}: its vocabulary ({cfg.vocab_size}) is not the "
                              f"target's ({tcfg.vocab_size}); the draft model must share the target's tokenizer")
        if cfg.context_len < tcfg.context_len:
            raise ConfigError(f"--speculative-draft-model-path {path}: its context ({cfg.context_len}) is shorter "
                              f"than the target's ({tcfg.context_len})")
        self.draft_len = draft_len
        self.page_size = ps
        self.allocator = self.runner.allocator
        self.table = self.runner.req_to_token_pool
        self.draft_lens = [0] * slots
        self.target_table = target.req_to_token_pool
        self.mirror_slots = 0  # P/D: slots below it are the target's numbering (0: the whole pool is the draft's)
        if args.disaggregation_mode in ("prefill", "decode"):
            self._share_target_slots(target, path)
        r = self.runner
        r.draft_extend_graph_runner = build_draft_extend_graph_runner(draft_args, r.model, r.kv_pool,
                                                                      r.req_to_token_pool, r.attn_backend)
        target.req_to_token_pool.on_free = self.release
        logger.info("STANDALONE draft model %s: %d draft tokens per step%s", path, draft_len,
                    ", its prompt KV at the target's slots (P/D)" if self.mirror_slots else "")

    def _share_target_slots(self, target: ModelRunner, path: str) -> None:
        """P/D: the pool's first pages mirror the target's (their draft KV travels as more layers after the target's);
        the allocator hands out only the pages past them."""
        pool, tpool = self.runner.kv_pool, target.kv_pool
        own = pool.num_pages - tpool.num_pages
        if own <= 0:
            raise ConfigError(f"--speculative-draft-model-path {path}: its KV pool ({pool.num_pages} pages) does not "
                              f"hold the target's {tpool.num_pages} pages and a headroom; raise --max-total-tokens")
        self.allocator = TokenToKVPoolAllocator(own, self.page_size, first_page=tpool.num_pages + 1)
        self.mirror_slots = n = tpool.k_buffer[0].shape[0]
        digest = draft_fingerprint(path, self.runner.model_config.fingerprint())
        target.draft_kv = DraftKV(layers=tuple((k[:n], v[:n]) for k, v in zip(pool.k_buffer, pool.v_buffer,
                                                                               strict=True)),
                                  state_dims=(0, 0), fingerprint={"draft_model": f"STANDALONE:{digest}"},
                                  total_kv_heads=self.runner.model_config.num_kv_heads)
        self.capture: frozenset[int] = frozenset()  # the final hidden states: the target's step runners serve it
        target.set_spec_hook(self)

    # -- Drafter -----------------------------------------------------------------------------------------------------
    def propose(self, reqs: list[Req], caps: list[int]) -> list[list[int]]:
        active = [i for i, c in enumerate(caps) if c > 0]
        out: list[list[int]] = [[] for _ in reqs]
        if not active:
            return out
        for i in active:
            self._sync(reqs[i])
        first = self._extend([reqs[i] for i in active])
        if first is None:
            return out
        for i, token in zip(active, first, strict=True):
            out[i].append(token)
        for step in range(1, max(caps)):
            live = [i for i in active if caps[i] > step]
            tokens = self._decode([reqs[i] for i in live], [out[i][-1] for i in live])
            if tokens is None:
                break
            for i, token in zip(live, tokens, strict=True):
                out[i].append(token)
        return out

    def on_verified(self, req: Req, drafted: int, accepted: int) -> None:
        """P/D: the draft KV of the positions the verify committed moves to the target's slots now, so between steps
        the draft KV of the request's first ``Req.spec_state`` positions is under the target's slots (a decode node's
        retraction copies those to the host tier; ``after_forward`` extends a restored request's draft from there).
        Colocated: nothing to adapt; the next ``propose`` trims the draft KV to what the verify kept."""
        if self.mirror_slots and req.req_pool_idx is not None:
            self._sync(req)
            req.spec_state = self.draft_lens[req.req_pool_idx]  # after a full accept: one position short of the KV

    def release(self, rows: list[int]) -> None:
        for r in rows:
            self._truncate(r, 0)

    def close(self) -> None:
        for r in range(len(self.draft_lens)):
            self._truncate(r, 0)

    def handoff(self, row: int) -> DraftHandoff | None:
        """P/D prefill node: the draft KV of the row's first ``draft_lens`` positions is at the target's slots."""
        return DraftHandoff(kv_len=self.draft_lens[row]) if self.mirror_slots and self.draft_lens[row] else None

    def resume(self, row: int, handoff: DraftHandoff) -> None:
        """P/D decode node: the row landed with the draft KV of its first ``kv_len`` positions at its target slots."""
        if not self.mirror_slots or not handoff.kv_len:
            return
        self._truncate(row, 0)
        self.table.write(row, 0, self.target_table.req_to_token[row, : handoff.kv_len])
        self.draft_lens[row] = handoff.kv_len

    # -- the target runner's hook (P/D nodes) ------------------------------------------------------------------------
    def after_forward(self, b: ModelWorkerBatch, fb: ForwardBatch, features: torch.Tensor,
                      next_token_ids: torch.Tensor) -> None:
        """After a target prefill forward: the draft extends over each prefill row's chunk at the target's slots."""
        if not fb.forward_mode.is_extend():
            return
        picked, starts, start = [], [], 0
        for i, req in enumerate(b.reqs):
            if b.seq_lens[i] <= len(req.fill_ids):  # a prefill row (a MIXED batch's decode rows run past fill_ids)
                picked.append(i)
                starts.append(start)
            start += b.extend_lens[i]
        if not picked:
            return
        reqs = [b.reqs[i] for i in picked]
        rows = [b.req_pool_indices[i] for i in picked]
        seq, prefix = [b.seq_lens[i] for i in picked], []
        input_ids: list[int] = []
        locs = []
        for i, at in zip(picked, starts, strict=True):
            req, p, row = b.reqs[i], b.prefix_lens[i], b.req_pool_indices[i]
            # a decode node's request restored from the host tier: its draft KV reaches where its last verify left it
            start = min(p, req.spec_state) if isinstance(req.spec_state, int) else p
            if start < p:
                input_ids.extend(req.fill_ids[start:p])
                locs.append(self.target_table.req_to_token[row, start:p].to(b.out_cache_loc.dtype))
            input_ids.extend(b.input_ids[at : at + b.extend_lens[i]])
            locs.append(b.out_cache_loc[at : at + b.extend_lens[i]])
            prefix.append(start)
        for row, s in zip(rows, seq, strict=True):
            self._truncate(row, 0)
            self.table.write(row, 0, self.target_table.req_to_token[row, :s])
            self.draft_lens[row] = s
        # EXTEND (SGLang's draft prefill): prefill-time extends never go to the decode-time extend runner
        self._forward(ForwardMode.EXTEND, reqs, input_ids, torch.cat(locs), rows, seq, prefix)

    # -- internals ---------------------------------------------------------------------------------------------------
    def _truncate(self, row: int, keep: int) -> None:
        have = self.draft_lens[row]
        first_free = -(-keep // self.page_size) * self.page_size
        if first_free < have:
            slots = self.table.req_to_token[row, first_free:have]
            self.allocator.free(slots[slots >= self.mirror_slots] if self.mirror_slots else slots)
        self.draft_lens[row] = min(have, keep)

    def _sync(self, req: Req) -> None:
        row = req.req_pool_idx
        assert row is not None
        if not self.mirror_slots:
            self._truncate(row, req.kv_committed_len)
            return
        # P/D: the committed positions' draft KV moves from own pages to the target's slots; no own page stays.
        have = self.draft_lens[row]
        keep = min(have, req.kv_committed_len)
        slots = self.table.req_to_token[row, :have].clone()  # the writes below change the row
        own = slots >= self.mirror_slots
        moved = torch.nonzero(own[:keep]).flatten()
        if len(moved):
            dst = self.target_table.req_to_token[row, moved]
            compact_path_kv([self.runner.kv_pool], slots[moved].tolist(), dst.tolist())
            self.table.write_points([row] * len(moved), moved.tolist(), dst)
        if bool(own.any()):
            self.allocator.free(slots[own])
        self.draft_lens[row] = keep

    def _last_locs(self, rows: list[int], lens: list[int]) -> list[int]:
        return [int(self.table.req_to_token[r, n - 1]) if n else -1 for r, n in zip(rows, lens, strict=True)]

    def _extend(self, reqs: list[Req]) -> list[int] | None:
        """One forward over the tokens of each request the draft has not seen; its next token per request."""
        rows: list[int] = [r.req_pool_idx for r in reqs]  # type: ignore[misc]
        prefix = [self.draft_lens[r] for r in rows]
        seq = [r.seqlen for r in reqs]
        # P/D: committed positions the draft has not seen (a prompt whose draft KV did not land) go to the target's
        # slots, as the prefill node's would have; only the positions past them take own pages
        own = [max(p, min(r.kv_committed_len, s)) if self.mirror_slots else p
               for r, p, s in zip(reqs, prefix, seq, strict=True)]
        for row, p, o in zip(rows, prefix, own, strict=True):
            if o > p:
                self.table.write(row, p, self.target_table.req_to_token[row, p:o])
        out = self.allocator.alloc_extend(own, seq, self._last_locs(rows, own))
        if out is None:
            return None
        input_ids: list[int] = []
        locs, at = [], 0
        for req, row, p, o, s in zip(reqs, rows, prefix, own, seq, strict=True):
            self.table.write(row, o, out[at : at + s - o])
            locs += [self.table.req_to_token[row, p:o], out[at : at + s - o]]
            at += s - o
            input_ids.extend(req.all_ids()[p:s])
            self.draft_lens[row] = s
        return self._forward(ForwardMode.DRAFT_EXTEND, reqs, input_ids, torch.cat(locs), rows, seq, prefix)

    def _decode(self, reqs: list[Req], tokens: list[int]) -> list[int] | None:
        """One decode forward feeding each request its newest draft token; its next draft token."""
        rows: list[int] = [r.req_pool_idx for r in reqs]  # type: ignore[misc]
        seq = [self.draft_lens[r] + 1 for r in rows]
        out = self.allocator.alloc_decode(seq, self._last_locs(rows, [s - 1 for s in seq]))
        if out is None:
            return None
        self.table.write_points(rows, [s - 1 for s in seq], out)
        for r, s in zip(rows, seq, strict=True):
            self.draft_lens[r] = s
        return self._forward(ForwardMode.DECODE, reqs, tokens, out, rows, seq, [s - 1 for s in seq])

    def _forward(self, mode: ForwardMode, reqs: list[Req], input_ids: list[int], out: torch.Tensor, rows: list[int],
                 seq: list[int], prefix: list[int]) -> list[int]:
        b = ModelWorkerBatch(
            forward_mode=mode, input_ids=input_ids, out_cache_loc=out, req_pool_indices=rows, seq_lens=seq,
            prefix_lens=prefix, extend_lens=[s - p for s, p in zip(seq, prefix, strict=True)], reqs=reqs,
            return_logprob=False,
        )
        b.sampling_info = SamplingBatchInfo.from_reqs([_GreedyRow()] * len(reqs), self.runner.model_config.vocab_size,
                                                      self.runner.device)  # type: ignore[list-item]
        return self.runner.forward_and_sample(b).next_token_ids


def draft_fingerprint(path: str, config_fingerprint: dict[str, object], blocks: int = 16) -> str:
    """The draft model's identity in the P/D handshake: its config's fingerprint (shapes, dtype, weight names) and
    a sample of its weight files' bytes (each file's size and ``blocks`` evenly spaced 64 KiB blocks), so two
    checkpoints of one shape differ without reading whole files."""
    digest = hashlib.sha256(json.dumps(config_fingerprint, sort_keys=True, default=str).encode())
    files = sorted(f for f in Path(path).iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}\n".encode())
        with f.open("rb") as fh:
            for k in range(blocks):
                fh.seek(size * k // blocks)
                digest.update(fh.read(1 << 16))
    return digest.hexdigest()[:16]


def build_drafter(args: ServerArgs, runner: ModelRunner, draft_len: int, dp_rank: int) -> StandaloneDrafter:
    return StandaloneDrafter(args, runner, draft_len, dp_rank)
