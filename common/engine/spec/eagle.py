"""``EagleDrafter``: EAGLE / EAGLE3 speculation. A draft head (``eagle_model``) over the target's features drafts a
chain (``--speculative-eagle-topk 1``) or a tree of ``num_steps`` levels of ``topk`` branches, of which the
``num_draft_tokens`` best nodes are verified.

Per step of a request (``EagleWorker`` does the head's forwards)::

    target forward (any: prefill chunk, decode, verify)  -> the model runner's spec_hook, ``after_forward``:
        verify:   the accepted path (the scheduler's rule, ``VerifyInput.path``); a tree's path KV moved into place
        DRAFT_EXTEND over the request's committed rows: tokens x_{p+1} (the last one the target's new token) with the
                  target's features at p; the head's K/V lands at the target's slots; the request's state is kept
    propose:  the draft steps from each request's state -> chains, or ``TreeDrafts``

The head's forwards run as CUDA graphs / compiled steps where the flags allow: its draft steps
(``eagle_graph_runner``) and its extends after a verify or decode step (``draft_extend_graph_runner``); its extends
over a prefill forward's rows eagerly.

The state of a request slot (top-k of its last row, the head's feature there) is valid from its first prefill chunk
on. In P/D the prefill node runs the head too: the head's KV layer travels with the target's (``DraftKV``: the
pool's slots below the scratch, the target's numbering) and the state with the metadata (``handoff`` / ``resume``;
the forward that completes a prompt reads its state to the host, on the forward thread, so under the overlap
schedule the scheduler thread sends it without waiting for the next forward), so the decode node drafts from its
first step. A request without a state decodes one plain step, then has one.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

import torch

from common.engine.forward_batch import ForwardMode
from common.engine.spec.draft_extend_graph_runner import build_eagle_extend_graph_runner
from common.engine.spec.drafter import DraftHandoff, DraftKV
from common.engine.spec.eagle_graph_runner import build_draft_graph_runner
from common.engine.spec.eagle_loader import load_eagle_head
from common.engine.spec.eagle_worker import DraftState, EagleWorker
from common.engine.spec.path_kv import compact_path_kv, path_moves
from common.engine.spec.tree import TreeDrafts
from common.errors import ConfigError
from common.speculative import max_draft_tokens

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.forward_batch import ForwardBatch
    from common.engine.model_runner import ModelRunner
    from common.engine.req import Req
    from common.engine.schedule_batch import ModelWorkerBatch

logger = logging.getLogger(__name__)


class EagleDrafter:
    def __init__(self, args: ServerArgs, runner: ModelRunner, draft_len: int) -> None:
        path, algo = args.speculative_draft_model_path, args.speculative_algorithm
        assert path is not None and algo is not None
        self.head = load_eagle_head(path, algo, runner.model, runner.dtype, runner.device)
        self.topk = args.speculative_eagle_topk or 1
        window = runner.model_config.sliding_window
        if self.topk > 1 and window is not None and draft_len >= window:
            raise ConfigError(f"--speculative-num-steps {draft_len} reaches the target's sliding window ({window}): "
                              "a tree's drafts see each other unwindowed; draft fewer steps")
        self.worker = EagleWorker(self.head, runner.kv_pool.num_pages, args.page_size, args.max_running_requests,
                                  self.topk, draft_len, max_draft_tokens(args) + 1, args.resolved_attention_backend)
        # The draft steps' rows read a branch table as wide as the target's plus the steps' chain.
        width = runner.req_to_token_pool.device_req_to_token.shape[1] + draft_len
        w = self.worker
        w.graph_runner = build_draft_graph_runner(args, self.head, w.kv_pool, w.attn_backend, self.topk, w.max_batch,
                                                  draft_len, width)
        w.extend_graph_runner = build_eagle_extend_graph_runner(args, self.head, w.kv_pool, runner.req_to_token_pool,
                                                                w.attn_backend, draft_len)
        self.runner = runner
        self.capture = self.head.config.capture
        slots = runner.req_to_token_pool.size + 1
        device = runner.device
        self.state = DraftState(torch.zeros(slots, self.topk, device=device),
                                torch.zeros(slots, self.topk, dtype=torch.int64, device=device),
                                torch.zeros(slots, self.head.hidden_size, dtype=runner.dtype, device=device))
        self.ready = [False] * slots
        # A prefill node's handoffs, read to the host by the forward that completed each prompt (``after_forward``)
        self.prefill_node = args.disaggregation_mode == "prefill"
        self.handoffs: dict[int, DraftHandoff] = {}
        pool, n = self.worker.kv_pool, runner.kv_pool.k_buffer[0].shape[0]
        # The whole head's geometry (every rank's shard derives from it): the same on P and D whatever their tp.
        cfg, lc = self.head.config, self.head.config.layer
        shapes = (lc.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.intermediate_size, cfg.fc_in,
                  cfg.fc_bias, cfg.draft_vocab_size, cfg.own_lm_head, sorted(cfg.capture))
        runner.draft_kv = DraftKV(
            layers=((pool.k_buffer[0][:n], pool.v_buffer[0][:n]),),
            state_dims=(self.topk, self.head.hidden_size),
            fingerprint={"draft_head": f"{algo}:{hashlib.sha256(repr(shapes).encode()).hexdigest()}",
                         "draft_topk": str(self.topk)},
            total_kv_heads=lc.num_kv_heads,
        )
        runner.set_spec_hook(self)
        runner.req_to_token_pool.on_free = self.release
        logger.info("%s draft head %s: %d steps, topk %d, %d tokens verified per request", algo, path, draft_len,
                    self.topk, max_draft_tokens(args) + 1)

    # -- the model runner's hook -------------------------------------------------------------------------------------
    def after_forward(self, b: ModelWorkerBatch, fb: ForwardBatch, features: torch.Tensor,
                      next_token_ids: torch.Tensor) -> None:
        if fb.batch_size == 0 or fb.forward_mode == ForwardMode.IDLE:
            return
        if fb.forward_mode.is_target_verify():
            self._extend_verified(fb, features, next_token_ids)
            return
        # rows [prefix, seq) of request i read x_{p+1}: its next input, or the sampled token after its last row
        ids = torch.empty_like(fb.input_ids)
        ids[:-1] = fb.input_ids[1:]
        last = fb.last_token_indices()
        nxt = next_token_ids.to(ids.device).clone()
        for i, req in enumerate(b.reqs):
            seq, prompt = b.seq_lens[i], len(req.origin_input_ids)
            if seq < prompt + len(req.output_ids):  # a prefill chunk that is not the last: the tokens go on
                nxt[i] = req.origin_input_ids[seq] if seq < prompt else req.output_ids[seq - prompt]
        ids[last] = nxt
        # a prefill forward's rows: EXTEND (eager; SGLang's draft prefill); a decode step's one row: DRAFT_EXTEND
        mode = ForwardMode.DRAFT_EXTEND if fb.forward_mode.is_decode() else ForwardMode.EXTEND
        self._extend(ids, features, fb, b.prefix_lens, b.seq_lens, mode)
        if self.prefill_node:
            self._keep_handoffs([b.req_pool_indices[i] for i, req in enumerate(b.reqs)
                                 if b.seq_lens[i] == len(req.origin_input_ids)])

    def _keep_handoffs(self, rows: list[int]) -> None:
        """A prefill node: the state of the rows whose prompt this forward completed, read to the host here, on the
        forward thread in launch order (under the overlap schedule the scheduler thread sends it while the next
        forward runs, and a device read there would wait for that forward)."""
        if not rows:
            return
        idx = torch.tensor(rows, device=self.state.hidden.device)
        ids, p = self.state.topk_ids[idx].tolist(), self.state.topk_p[idx].tolist()
        hidden = self.state.hidden[idx].float().cpu().numpy().astype("<f4")
        for i, row in enumerate(rows):
            self.handoffs[row] = DraftHandoff(tuple(ids[i]), tuple(p[i]), hidden[i].tobytes())

    def _extend_verified(self, fb: ForwardBatch, features: torch.Tensor, next_token_ids: torch.Tensor) -> None:
        spec = fb.spec_info
        targets = next_token_ids.tolist()
        slots = fb.out_cache_loc.tolist()
        rows, src, dst, seq = [], [], [], []
        for i, c in enumerate(spec.committed):
            path = spec.path(i, targets)
            start = spec.offsets[i]
            rows += [start] + [start + 1 + j for j in path]
            if spec.parents is not None:
                s, d = path_moves(slots[start : start + 1 + len(spec.drafts[i])], path)
                src += s
                dst += d
            seq.append(c + 1 + len(path))
        compact_path_kv([self.runner.kv_pool], src, dst)
        index = torch.tensor(rows, device=features.device)
        ids = next_token_ids.to(features.device)[index]  # the emitted tokens: x_{p+1} of each kept row
        self._extend(ids, features[index], fb, spec.committed, seq, ForwardMode.DRAFT_EXTEND)

    def _extend(self, ids: torch.Tensor, features: torch.Tensor, fb: ForwardBatch, prefix: list[int],
                seq: list[int], mode: ForwardMode) -> None:
        state = self.worker.extend(ids, features, fb.req_pool_indices, list(prefix), list(seq), fb.req_to_token,
                                   mode)
        rows = fb.req_pool_indices.to(self.state.hidden.device)
        self.state.topk_p[rows] = state.topk_p
        self.state.topk_ids[rows] = state.topk_ids
        self.state.hidden[rows] = state.hidden.to(self.state.hidden.dtype)
        for r in fb.req_pool_indices.tolist():
            self.ready[r] = True

    # -- Drafter ---------------------------------------------------------------------------------------------------
    def propose(self, reqs: list[Req], caps: list[int]) -> list[list[int]] | TreeDrafts:
        active = [i for i, (r, c) in enumerate(zip(reqs, caps, strict=True))
                  if c > 0 and r.req_pool_idx is not None and self.ready[r.req_pool_idx]]
        tokens: list[list[int]] = [[] for _ in reqs]
        parents: list[list[int]] = [[] for _ in reqs]
        if active:
            rows: list[int] = [reqs[i].req_pool_idx for i in active]  # type: ignore[misc]
            idx = torch.tensor(rows, device=self.state.hidden.device)
            state = DraftState(self.state.topk_p[idx], self.state.topk_ids[idx], self.state.hidden[idx])
            verified = torch.tensor([reqs[i].next_input_id() for i in active])
            tree = self.worker.draft(state, verified, idx, [reqs[i].kv_committed_len for i in active],
                                     self.runner.req_to_token_pool.device_req_to_token)
            node_tokens, node_parents = tree.tokens[:, 1:].tolist(), (tree.parents[:, 1:] - 1).tolist()
            for a, i in enumerate(active):
                tokens[i], parents[i] = node_tokens[a], node_parents[a]
        if self.topk == 1:  # a chain in node order: the framework's linear verify
            return [t[:c] for t, c in zip(tokens, caps, strict=True)]
        return TreeDrafts(tokens, parents)

    def on_verified(self, req: Req, drafted: int, accepted: int) -> None:
        """Nothing to do: ``after_forward`` extended the head over the accepted run already."""

    def release(self, rows: list[int]) -> None:
        for r in rows:
            self.ready[r] = False
            self.handoffs.pop(r, None)

    def close(self) -> None:
        self.ready = [False] * len(self.ready)
        self.handoffs.clear()

    def handoff(self, row: int) -> DraftHandoff | None:
        """A prefill node: the state ``after_forward`` kept when the row's prompt completed (None: none)."""
        return self.handoffs.pop(row, None)

    def resume(self, row: int, handoff: DraftHandoff) -> None:
        s = self.state
        s.topk_ids[row] = torch.tensor(handoff.topk_ids, dtype=torch.int64, device=s.topk_ids.device)
        s.topk_p[row] = torch.tensor(handoff.topk_p, dtype=torch.float32, device=s.topk_p.device)
        hidden = torch.frombuffer(bytearray(handoff.hidden), dtype=torch.float32)
        s.hidden[row] = hidden.to(s.hidden.device, s.hidden.dtype)
        self.ready[row] = True


def build_drafter(args: ServerArgs, runner: ModelRunner, draft_len: int, dp_rank: int) -> EagleDrafter:
    return EagleDrafter(args, runner, draft_len)
