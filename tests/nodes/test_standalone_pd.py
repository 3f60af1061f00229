"""STANDALONE speculation through P/D, in this process (prefill and decode roles, TCP transfer on 127.0.0.1): the
prefill node runs the draft model over every prefill chunk at the target's slots and its KV travels with the
target's pages, so the decode node extends its draft over no prompt position and drafts from its first step; a pair
that holds different drafts (or a prefill node without one) is refused at the handshake naming the draft.

The draft is the target itself: with its KV right every draft is accepted, so a wrong draft KV (a page the prefill
node's draft did not write, a radix hit without it) shows as a rejected draft."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput, TokenOut
from common.engine.mem.pages import num_pages
from common.engine.scheduler import Scheduler
from common.engine.spec.standalone import StandaloneDrafter
from common.text.tokenizer import load_tokenizer
from tests.conftest import assert_scheduler_pools_released
from tests.engine.test_spec_decode import greedy, prompt, run
from tests.model_fixtures import make_copy_model, make_tiny_model
from tests.nodes.test_decode_shared_prompts import drive, finals, idle, tokens_of

CLUSTER_TOKEN = "test-cluster-token"
STEPS = 3
# "c" shares "a"'s first 32 tokens and comes after it: a radix hit on the prefill node (its draft KV too)
PROMPTS = {"a": prompt(37, 3), "b": prompt(20, 4), "c": prompt(37, 3)[:32] + prompt(9, 5)}
NEW = 1 + 4 * (STEPS + 1)
PREFILL_OVERLAP = {"disable_overlap_schedule": False, "enable_overlap_schedule": True}  # on CPU too


@pytest.fixture(scope="module")
def setup() -> Iterator[dict[str, Any]]:
    from kvtransfer.bootstrap import BootstrapServer

    model = str(make_tiny_model("llama"))
    reqs = [GenerateReqInput(rid=r, input_ids=p, sampling_params=greedy(NEW)) for r, p in PROMPTS.items()]
    plain, _ = run(model, reqs)
    server = BootstrapServer(CLUSTER_TOKEN)
    port = server.start()
    try:
        yield {"model": model, "expected": plain.ids, "port": port}
    finally:
        server.stop()


def standalone(draft: str) -> dict[str, Any]:
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": draft,
            "speculative_num_steps": STEPS}


def serve_pd(setup: dict[str, Any], monkeypatch, prefill_spec: dict[str, Any], decode_spec: dict[str, Any],
             page_size: int, room: int, prompts: dict[str, list[int]] = PROMPTS,
             served: Callable[[str, Scheduler], None] | None = None, together: bool = False
             ) -> tuple[dict[str, list[int]], dict[str, TokenOut], int]:
    """The prompts one at a time (or ``together``) through a prefill and a decode scheduler (``served(rid,
    prefill)`` after each); (tokens, finals, prompt positions the decode node's draft extended over)."""
    from decode_node.role import DecodeRole
    from prefill_node.role import PrefillRole

    monkeypatch.setenv("PDCLUSTER_CLUSTER_TOKEN", CLUSTER_TOKEN)
    model, port = setup["model"], setup["port"]
    base = ServerArgs(model_path=model, page_size=page_size, max_total_tokens=2048, max_running_requests=8,
                      chunked_prefill_size=16, disaggregation_bootstrap_port=port, disable_overlap_schedule=True)
    pargs = base.replace(disaggregation_mode="prefill", **prefill_spec)
    dargs = base.replace(disaggregation_mode="decode", **decode_spec)
    prompt_positions = [0]
    extend = StandaloneDrafter._extend

    def counting(self: StandaloneDrafter, reqs: list[Any]) -> Any:
        for r in reqs:
            prompt_positions[0] += max(0, len(r.origin_input_ids) - self.draft_lens[r.req_pool_idx])
        return extend(self, reqs)

    monkeypatch.setattr(StandaloneDrafter, "_extend", counting)
    tokenizer = load_tokenizer(model)
    out: list[Any] = []
    prefill = Scheduler(pargs, model, tokenizer, lambda outs: None, role=PrefillRole(pargs))
    decode = Scheduler(dargs, model, tokenizer, out.extend, role=DecodeRole(dargs))
    try:
        msgs = [GenerateReqInput(rid=rid, input_ids=ids, sampling_params=greedy(NEW), bootstrap_room=room + i,
                                 bootstrap_addr=f"127.0.0.1:{port}") for i, (rid, ids) in enumerate(prompts.items())]
        for batch in [msgs] if together else [[m] for m in msgs]:  # one at a time: "c" finds "a"'s prefix cached
            decode.step(batch)
            prefill.step(batch)
            drive(prefill, decode, idle(prefill, decode))
            if served is not None:
                for m in batch:
                    served(m.rid, prefill)
        assert_scheduler_pools_released(prefill, decode)
        for s in (prefill, decode):
            drafter = s.decode.speculator.drafter if s.decode.speculator is not None else None
            if isinstance(drafter, StandaloneDrafter):  # the draft's own pages: all back
                assert drafter.allocator.available_size() == drafter.allocator.size
    finally:
        prefill.close()
        decode.close()
    return tokens_of(out), finals(out), prompt_positions[0]


@pytest.mark.parametrize(("page_size", "overlap", "together"), [(1, False, False), (16, False, False),
                                                                 (16, True, False), (16, True, True)])
def test_the_decode_node_drafts_from_the_prefill_nodes_draft_kv(setup, monkeypatch, page_size, overlap,
                                                               together) -> None:
    """With ``overlap`` the prefill node runs the overlap schedule (forced on CPU): the draft's extend is the target
    forward's hook on the forward thread, in launch order, so the same draft KV lands; ``together``, a request's
    result (its draft handoff, its last pages) is sent while the next batch's chunks run. Each request's
    ``transfer_bytes`` counts the draft's layers that moved with the target's."""
    spec = standalone(setup["model"])
    page_bytes: list[int] = []

    def served(rid: str, prefill: Scheduler) -> None:
        assert prefill.overlap is overlap
        runner = prefill.runner
        layers = [*zip(runner.kv_pool.k_buffer, runner.kv_pool.v_buffer, strict=True), *runner.draft_kv.layers]
        page_bytes.append(sum(buf[:page_size].nbytes for kv in layers for buf in kv))

    prefill_spec = {**spec, **PREFILL_OVERLAP} if overlap else spec
    ids, ends, prompt_positions = serve_pd(setup, monkeypatch, prefill_spec, spec, page_size,
                                           9000 + 10 * page_size + 4 * overlap + 3 * together, served=served,
                                           together=together)
    assert ids == setup["expected"]
    assert prompt_positions == 0  # the draft KV of every prompt position came with the transfer
    if not together:  # "a"'s prefix, its draft KV with it, from the prefill node's radix cache
        assert ends["c"].cached_tokens == 32
    for rid, f in ends.items():  # the draft is the target: with its KV right every draft is accepted
        assert f.spec_draft_tokens > 0 and f.spec_accepted_tokens == f.spec_draft_tokens, rid
        assert f.timing is not None
        assert f.timing.transfer_bytes == num_pages(len(PROMPTS[rid]), page_size) * page_bytes[0], rid


def test_a_prefix_back_from_the_host_tier_brings_its_draft_kv(setup, monkeypatch) -> None:
    """--enable-hierarchical-cache on both nodes, a prefill pool of six pages: a prompt that fills the pool evicts
    "a"'s prefix to the host, and "c" loads it back into pages that prompt's KV was in. The draft's KV at "c"'s
    prefix slots is what it wrote for "a" before the eviction, and (the draft being the target) every draft is
    accepted: the decode node drafted from the draft KV that came back from the host."""
    spec = {**standalone(setup["model"]), "enable_hierarchical_cache": True}
    prompts = {"a": PROMPTS["a"], "fill": prompt(90, 6), "c": PROMPTS["c"]}
    draft_kv: dict[str, list[Any]] = {}
    host_hits: list[int] = []

    def served(rid: str, prefill: Scheduler) -> None:
        cache = prefill.tree_cache
        if rid != "fill":
            slots = cache.match_prefix(PROMPTS["a"][:32]).device_indices
            assert len(slots) == 32, rid
            draft_kv[rid] = [buf[slots].clone() for layer in prefill.runner.draft_kv.layers for buf in layer]
        host_hits.append(cache.hicache_report().hit_tokens["host"])

    ids, ends, prompt_positions = serve_pd(setup, monkeypatch, {**spec, "max_total_tokens": 96}, spec, 16, 9500,
                                           prompts, served)
    assert (ids["a"], ids["c"]) == (setup["expected"]["a"], setup["expected"]["c"])
    assert host_hits == [0, 0, 32] and ends["c"].cached_tokens == 32  # "a"'s prefix came back from the host
    assert all(a.equal(c) for a, c in zip(draft_kv["a"], draft_kv["c"], strict=True))
    assert prompt_positions == 0
    for rid, f in ends.items():
        assert f.spec_draft_tokens > 0 and f.spec_accepted_tokens == f.spec_draft_tokens, rid


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_draft_of_another_kv_geometry_travels_as_its_own_layer_group(setup, monkeypatch, backend) -> None:
    """A qwen3 draft (KV head dim 48) for the llama target (32): its layers move by a backend of their own; its
    drafts on the decode node are those of a colocated node, whose draft extended over the prompt itself."""
    spec = standalone(str(make_tiny_model("qwen3")))
    reqs = [GenerateReqInput(rid=r, input_ids=p, sampling_params=greedy(NEW)) for r, p in PROMPTS.items()]
    colocated, _ = run(setup["model"], reqs, spec, page_size=16, chunked_prefill_size=16, steps_between=40)
    spec_pd = {**spec, "kv_transfer_backend": backend}
    ids, ends, prompt_positions = serve_pd(setup, monkeypatch, spec_pd, spec_pd, 16, 9300 + 10 * len(backend))
    assert ids == setup["expected"] == colocated.ids
    assert prompt_positions == 0
    assert {r: (f.spec_draft_tokens, f.spec_accepted_tokens) for r, f in ends.items()} == {
        r: (f.spec_draft_tokens, f.spec_accepted_tokens) for r, f in colocated.final.items()}
    assert sum(f.spec_accepted_tokens for f in ends.values()) > 0


@pytest.mark.parametrize("prefill_draft", ["none", "another"])
def test_a_pair_holding_different_drafts_is_refused_naming_the_draft(setup, monkeypatch, prefill_draft) -> None:
    decode_spec = standalone(setup["model"])
    prefill_spec = {} if prefill_draft == "none" else standalone(str(make_copy_model()))
    prefill_spec["bootstrap_timeout"] = 2.0  # the prefill side's room waits this long for a decode that never comes
    room = 9100 if prefill_draft == "none" else 9200
    ids, ends, _ = serve_pd(setup, monkeypatch, prefill_spec, decode_spec, 16, room, {"a": PROMPTS["a"]})
    assert list(ends) == ["a"] and not ids.get("a")
    error = ends["a"].error or ""
    assert ends["a"].finish_reason == "abort" and "model draft_model: prefill=" in error
    assert "same --speculative-algorithm and --speculative-draft-model-path" in error
