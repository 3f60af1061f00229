"""Speculative decoding with a draft model or head under tp 2 (one spawned pair of gloo ranks): the greedy output is
token for token the tp 1 output without speculation, both ranks draft the same tokens, and every pool (the draft
model's too) comes back whole.

- STANDALONE with the target as its own draft, sharded over the target's group: every draft is accepted (a draft
  whose TP forward were wrong would be rejected).
- EAGLE, a tree (topk 3), a random head sharded over the group: its drafts, recorded per rank, are the same on both
  ranks; its KV layer has the target pool's per-rank shape (what P/D sends as one more layer).
- EAGLE3, a tree (topk 2): the head drafts (recorded), then a scripted tree that puts the target's continuation off
  the first branch is verified instead, so accepted paths' KV moves on each rank's heads.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from common.engine.distributed import TPGroup
from tests.engine.test_spec_decode import gen, greedy, prompt, run
from tests.tp_helpers import run_ranks

pytestmark = pytest.mark.slow  # spawns rank processes
SHAPE = {"page_size": 16, "chunked_prefill_size": 32, "max_total_tokens": 4096, "max_running_requests": 16,
         "disable_overlap_schedule": True}
STANDALONE = {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3}
EAGLE_TREE = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2, "speculative_eagle_topk": 3,
              "speculative_num_draft_tokens": 5}
EAGLE3_TREE = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 2,
               "speculative_num_draft_tokens": 7}


def _reqs() -> list:
    return [gen("a", prompt(21, 1), greedy(16)), gen("long", prompt(70, 2), greedy(12)),
            gen("b", prompt(40, 7), greedy(16))]


def _serve(tp: TPGroup, model: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The requests to the end on a tp scheduler with ``spec``: outputs, per-request accounting, leaks."""
    from common.config import ServerArgs
    from common.engine.io_struct import TokenOut
    from common.engine.scheduler import Scheduler
    from common.text.tokenizer import load_tokenizer

    ids: dict[str, list[int]] = {}
    final: dict[str, tuple[int, int, int]] = {}

    def sink(msgs: list[Any]) -> None:
        for m in msgs:
            if isinstance(m, TokenOut):
                ids.setdefault(m.rid, []).extend(m.token_ids)
                if m.finish_reason is not None:
                    final[m.rid] = (m.spec_verify_ct, m.spec_draft_tokens, m.spec_accepted_tokens)

    args = ServerArgs(model_path=model, tp_size=2, **SHAPE, **spec)
    sched = Scheduler(args, model, load_tokenizer(model), sink, 0, tp)
    out: dict[str, Any] = {"layout": None}
    try:
        draft_kv = sched.runner.draft_kv
        if draft_kv is not None:  # P/D registers the head's KV as one more layer of the target pool's shape
            from kvtransfer.args import KVArgs

            kv = KVArgs.from_pool(sched.runner.kv_pool, tp_rank=tp.tp_rank, tp_size=2, extra_layers=draft_kv.layers,
                                  total_kv_heads=sched.model_config.num_kv_heads)
            out["layout"] = (kv.num_layers, kv.kv_heads, draft_kv.fingerprint)
        sched.step(_reqs())
        deadline = time.monotonic() + 120
        while not sched.is_idle() and time.monotonic() < deadline:  # the same steps on both ranks
            sched.step([])
        out["leak"] = _leak(sched)
    finally:
        sched.close()
    return {**out, "ids": ids, "final": final}


def _leak(s: Any) -> str | None:
    if s.req_to_token_pool.available_size() != s.req_to_token_pool.size:
        return "request slots leaked"
    if s.tree_cache.protected_size():
        return "prefix cache holds locked nodes"
    s.tree_cache.evict(s.allocator.size)
    if s.allocator.available_size() != s.allocator.size:
        return "KV slots leaked"
    draft = getattr(s.decode.speculator.drafter, "allocator", None)  # STANDALONE's own pool
    if draft is not None and draft.available_size() != draft.size:
        return "draft KV slots leaked"
    return None


def _ranks(tp: TPGroup, model: str, heads: dict[str, str], plain: dict[str, list[int]]) -> dict[str, Any]:
    from common.engine.spec.eagle import EagleDrafter
    from common.engine.spec.tree import TreeDrafts
    from tests.engine.test_eagle_decode import _scripted_trees

    real, drafted = EagleDrafter.propose, []
    scripted = [None]

    def recorded(self: EagleDrafter, reqs: list, caps: list[int]) -> Any:
        proposed = real(self, reqs, caps)
        assert isinstance(proposed, TreeDrafts)
        drafted.append((proposed.tokens, proposed.parents))
        return proposed if scripted[0] is None else scripted[0](self, reqs, caps)

    EagleDrafter.propose = recorded  # type: ignore[method-assign]
    out = {"standalone": _serve(tp, model, {**STANDALONE, "speculative_draft_model_path": model}),
           "eagle": _serve(tp, model, {**EAGLE_TREE, "speculative_draft_model_path": heads["EAGLE"]})}
    out["eagle_drafts"], drafted[:] = list(drafted), []
    scripted[0] = _scripted_trees(plain, 1536)
    out["eagle3"] = _serve(tp, model, {**EAGLE3_TREE, "speculative_draft_model_path": heads["EAGLE3"]})
    out["eagle3_drafts"] = drafted
    return out


@pytest.fixture(scope="module")
def tp2() -> tuple[dict[str, list[int]], list[dict[str, Any]]]:
    """The tp 1 output without speculation, and what each rank of one spawned tp 2 pair produced."""
    from tests.engine.test_eagle_head import head_dir
    from tests.model_fixtures import make_tiny_model

    model = str(make_tiny_model("llama"))
    plain, _ = run(model, _reqs(), together=True, page_size=16, chunked_prefill_size=32)
    heads = {kind: str(head_dir(kind)) for kind in ("EAGLE", "EAGLE3")}
    return plain.ids, run_ranks(_ranks, 2, model, heads, plain.ids, deadline_s=300)


def _check(plain: dict[str, list[int]], ranks: list[dict[str, Any]], key: str) -> dict[str, Any]:
    r0, r1 = (r[key] for r in ranks)
    assert r0["leak"] is None and r1["leak"] is None, (r0["leak"], r1["leak"])
    assert r0["ids"] == r1["ids"] == plain, key
    assert r0["final"] == r1["final"], key
    return r0


def test_standalone_tp2_target_as_draft_accepts_every_draft(tp2) -> None:
    plain, ranks = tp2
    r0 = _check(plain, ranks, "standalone")
    for rid, (verify_ct, drafted, accepted) in r0["final"].items():
        assert verify_ct > 0 and accepted == drafted > 0, (rid, verify_ct, drafted, accepted)


def test_eagle_tp2_tree_drafts_agree_across_ranks(tp2) -> None:
    plain, ranks = tp2
    r0 = _check(plain, ranks, "eagle")
    assert sum(drafted for _, drafted, _ in r0["final"].values()) > 0
    assert ranks[0]["eagle_drafts"] and ranks[0]["eagle_drafts"] == ranks[1]["eagle_drafts"]
    assert r0["layout"][:2] == (3 + 1, 1)  # the tiny target's 3 layers and the head's, 1 of 2 KV heads per rank
    assert r0["layout"][2] == _tp1_fingerprint(EAGLE_TREE, "EAGLE")  # a tp 1 node accepts this head's KV in P/D


def _tp1_fingerprint(spec: dict[str, Any], kind: str) -> dict[str, str]:
    from common.config import ServerArgs
    from common.engine.model_runner import ModelRunner
    from common.engine.spec import build_speculator
    from tests.engine.test_eagle_head import head_dir
    from tests.model_fixtures import make_tiny_model

    model = str(make_tiny_model("llama"))
    args = ServerArgs(model_path=model, **SHAPE, **spec, speculative_draft_model_path=str(head_dir(kind)))
    runner = ModelRunner(args, model)
    speculator = build_speculator(args, runner)
    assert speculator is not None and runner.draft_kv is not None
    speculator.close()
    return runner.draft_kv.fingerprint


def test_eagle3_tp2_accepted_tree_paths_keep_the_output(tp2) -> None:
    plain, ranks = tp2
    r0 = _check(plain, ranks, "eagle3")
    assert ranks[0]["eagle3_drafts"] and ranks[0]["eagle3_drafts"] == ranks[1]["eagle3_drafts"]
    for rid, (verify_ct, _, accepted) in r0["final"].items():
        assert accepted >= 3 * (verify_ct - 1) > 0, (rid, verify_ct, accepted)


def test_a_head_the_tp_size_cannot_split_is_refused_naming_it(monkeypatch) -> None:
    from common.engine.spec.eagle_loader import load_eagle_head
    from common.errors import ConfigError
    from tests.engine.test_eagle_head import head_dir
    from tests.model_fixtures import load_tiny_model

    target = load_tiny_model("llama")
    monkeypatch.setattr(target, "tp", TPGroup(0, 8))  # no process group: the head's layout is checked first
    with pytest.raises(ConfigError, match=f"--tp-size 8 does not divide the 4 attention heads of .* at "
                                          f"{head_dir('EAGLE3')}"):
        load_eagle_head(head_dir("EAGLE3"), "EAGLE3", target)
