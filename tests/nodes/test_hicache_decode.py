"""A decode node's host tier (``HiHeldPrefixCache``), in this process (prefill and decode roles, TCP transfer on
127.0.0.1, the overlap schedule on): a request retracted mid-decode keeps its KV on the host and resumes from it —
one token extended, not its whole sequence recomputed — with the colocated node's tokens; the device and host pools
come back whole (``pd_pair``). A restore whose copy hangs is given up at --hicache-load-timeout: the request is
recomputed, with the same tokens, and the restore's pages are free again while the copy still hangs. With
STANDALONE speculation (the overlap schedule off) the host copy keeps the draft's KV too, and with EAGLE its head's
KV: the restored request drafts what it drafts when recomputed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from common.config import ServerArgs
from common.engine.forward_batch import ForwardMode
from common.engine.io_struct import GenerateReqInput
from common.engine.sampling.params import SamplingParams
from common.text.tokenizer import load_tokenizer
from tests.model_fixtures import make_tiny_model
from tests.nodes.test_decode_shared_prompts import (
    colocated_tokens,
    drive,
    finals,
    idle,
    pd_pair,
    running,
    tokens_of,
)

PAGE = 4
PROMPTS = {"r-0": [(7 * j) % 500 + 20 for j in range(37)], "r-1": [(13 * j) % 700 + 9 for j in range(29)]}
SP = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def requests(port: int) -> list[GenerateReqInput]:
    return [GenerateReqInput(rid=rid, input_ids=list(p), sampling_params=SP, bootstrap_room=7000 + i,
                             bootstrap_addr=f"127.0.0.1:{port}") for i, (rid, p) in enumerate(PROMPTS.items())]


@pytest.fixture(scope="module")
def setup() -> Iterator[dict[str, Any]]:
    from kvtransfer.bootstrap import BootstrapServer

    model = str(make_tiny_model("llama"))
    tokenizer = load_tokenizer(model)
    bootstrap = BootstrapServer("test-cluster-token")
    port = bootstrap.start()
    base = ServerArgs(model_path=model, page_size=PAGE, max_total_tokens=1024, max_running_requests=8,
                      chunked_prefill_size=16, disaggregation_bootstrap_port=port)
    expected = colocated_tokens(base, model, tokenizer, [
        GenerateReqInput(rid=rid, input_ids=list(p), sampling_params=SP) for rid, p in PROMPTS.items()])
    yield {"model": model, "tokenizer": tokenizer, "port": port, "base": base, "expected": expected}
    bootstrap.stop()


@pytest.mark.parametrize("fault", [None, "hang", "offload"], ids=["restored", "restore-hangs", "offload-fails"])
def test_a_retracted_decode_request_resumes_from_its_host_copy(setup, monkeypatch, fault) -> None:
    """hang: the restore's copy hangs; past --hicache-load-timeout the request is recomputed instead (the same
    tokens) while the copy still hangs, its pages free again (it is cancelled: it never writes them). offload: the
    retraction's write to the host fails; the request keeps no host copy and is recomputed."""
    from common.engine.mem.hicache.copy_engine import CopyEngine

    release, copy, hang = threading.Event(), CopyEngine._copy_pages, fault == "hang"

    def hanging(self: CopyEngine, job: Any) -> Any:
        if job.kind == "load" and hang:
            release.wait(20)  # bounded: without the deadline the request waits this long, then is restored
        if job.kind == "write" and fault == "offload":
            raise RuntimeError("injected: the retraction's offload fails")
        return copy(self, job)

    monkeypatch.setattr(CopyEngine, "_copy_pages", hanging)
    timeout = {"hicache_load_timeout": 0.3} if hang else {}
    with pd_pair(setup, monkeypatch, enable_hierarchical_cache=True, hicache_ratio=1.0, **timeout) as (
            prefill, decode, out):
        msgs = requests(setup["port"])
        decode.step(msgs)
        prefill.step(msgs)
        drive(prefill, decode, lambda: len(running(decode, 5)) == 2)
        extends: list[tuple[str, int]] = []
        launch = decode.worker.worker_batch

        def record(batch: Any) -> Any:
            if batch.forward_mode == ForwardMode.EXTEND:
                extends.extend((r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens, strict=True))
            return launch(batch)

        monkeypatch.setattr(decode.worker, "worker_batch", record)
        live = running(decode)
        decode.preempt_running([live["r-0"]], live["r-1"])
        try:
            drive(prefill, decode, idle(prefill, decode))
            assert all(f.finish_reason == "length" for f in finals(out).values())
            assert tokens_of(out) == setup["expected"]
            if fault is None:
                assert extends == [("r-0", 1)], "the retracted request should resume from its host copy"
                assert decode.tree_cache.hicache_report().load_bytes > 0
                return
            if fault == "offload":
                assert {rid for rid, _ in extends} == {"r-0"} and sum(n for _, n in extends) > 1  # recomputed
                assert decode.tree_cache.hicache_report().load_bytes == 0 and not decode.tree_cache.offloads
                return
            assert {rid for rid, _ in extends} == {"r-0"} and sum(n for _, n in extends) > 1  # recomputed
            [abandoned] = decode.tree_cache.waits.abandoned
            assert not abandoned.job.done.is_set()  # answered while the restore still hangs
            assert abandoned.release is None  # cancelled before it wrote a page: idle, every page is free
            assert decode.allocator.available_size() == decode.allocator.size
            assert decode.tree_cache.host_pool.used_pages == 0
        finally:
            release.set()
        drive(prefill, decode, lambda: not decode.tree_cache.waits.stuck)  # then its pages come back


def test_a_retracted_standalone_request_resumes_drafting_from_its_host_copy(setup, monkeypatch) -> None:
    """STANDALONE on both nodes, the draft being the target: the retraction's host copy holds the draft's KV beside
    the target's, so the restored request extends one token and drafts from it: every draft is accepted. It is
    retracted right after a step whose drafts ran past its last target page (their KV in the draft's own pages):
    the verify moved the committed positions' draft KV to the target's slots, or the host copy would miss it; and
    after its full accept the draft never saw the last accepted token: the restore extends the draft over it."""
    from common.engine.spec.standalone import StandaloneDrafter

    spec = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": setup["model"],
            "speculative_num_steps": 2}  # 3 tokens a step: its drafts cross a page boundary every few steps
    pair = {**setup, "base": setup["base"].replace(**spec)}
    spilled: dict[str, bool] = {}
    propose = StandaloneDrafter.propose

    def spy(self: StandaloneDrafter, reqs: list[Any], caps: list[int]) -> Any:
        drafts = propose(self, reqs, caps)
        for r in reqs:
            if self.mirror_slots and r.req_pool_idx is not None:
                row = self.table.req_to_token[r.req_pool_idx, r.kv_committed_len: self.draft_lens[r.req_pool_idx]]
                spilled[r.rid] = bool((row >= self.mirror_slots).any())
        return drafts

    monkeypatch.setattr(StandaloneDrafter, "propose", spy)
    with pd_pair(pair, monkeypatch, overlap=False, enable_hierarchical_cache=True, hicache_ratio=1.0) as (
            prefill, decode, out):
        msgs = requests(setup["port"])
        decode.step(msgs)
        prefill.step(msgs)
        drive(prefill, decode, lambda: len(running(decode, 5)) == 2 and spilled.get("r-0", False))
        live = running(decode)
        r0, drafter = live["r-0"], decode.decode.speculator.drafter
        keep = min(r0.kv_committed_len, len(r0.all_ids()) - 1)  # what the retraction keeps
        buffers = [*drafter.runner.kv_pool.k_buffer, *drafter.runner.kv_pool.v_buffer]

        def draft_kv(slots: Any) -> list[Any]:
            return [buf[slots].clone() for buf in buffers]

        before = draft_kv(drafter.table.req_to_token[r0.req_pool_idx, :keep])  # the draft's KV, wherever it is
        extends: list[tuple[str, int]] = []
        restored: list[Any] = []
        off: list[float] = []
        launch = decode.worker.worker_batch
        target = [*decode.runner.kv_pool.k_buffer, *decode.runner.kv_pool.v_buffer]

        pending: list[Any] = []

        def record(batch: Any) -> Any:
            if pending:  # the step after the restore: the draft is the target, its KV of every position so far the
                slots = pending.pop()  # target's (to rounding), the one its last verify did not feed it included
                off.append(max(float((d[slots] - t[slots]).abs().max()) for d, t in zip(buffers, target, strict=True)))
            if batch.forward_mode == ForwardMode.EXTEND:
                extends.extend((r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens, strict=True))
                slots = decode.req_to_token_pool.req_to_token[r0.req_pool_idx, : keep + 1].clone()
                restored.extend(draft_kv(slots[:keep]))  # the draft's KV at the restored target slots
                pending.append(slots)
            return launch(batch)

        monkeypatch.setattr(decode.worker, "worker_batch", record)
        decode.preempt_running([r0], live["r-1"])
        drive(prefill, decode, idle(prefill, decode))
        assert tokens_of(out) == setup["expected"]
        assert extends == [("r-0", 1)], "the retracted request should resume from its host copy"
        assert all(a.equal(b) for a, b in zip(before, restored, strict=True))
        assert len(off) == 1 and off[0] < 1e-3, off
        for rid, f in finals(out).items():
            assert f.spec_draft_tokens > 0 and f.spec_accepted_tokens == f.spec_draft_tokens, rid


def test_a_retracted_eagle_request_resumes_drafting_from_its_host_copy(setup, monkeypatch) -> None:
    """EAGLE on both nodes: the retraction's host copy holds the head's KV layer beside the target's (moved by the
    code that moves a STANDALONE draft's layers), so the restored request extends one token, its head's KV at the
    restored slots the KV it had, and from there it drafts the trees the same request drafts when recomputed without
    a host tier (its head's KV computed again). Garbage head KV would show as other trees, the tokens unchanged."""
    from common.engine.spec.eagle_worker import EagleWorker
    from tests.engine.test_eagle_head import head_dir

    spec = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head_dir("EAGLE")),
            "speculative_num_steps": 2}
    pair = {**setup, "base": setup["base"].replace(**spec)}
    draft, watched = EagleWorker.draft, []

    def spy(self: EagleWorker, state: Any, verified: Any, pool_idx: Any, seq_lens: list[int], table: Any) -> Any:
        tree = draft(self, state, verified, pool_idx, seq_lens, table)
        if watched and (r0 := watched[0]).req_pool_idx in (rows := pool_idx.tolist()):  # r-0 since its retraction
            i = rows.index(r0.req_pool_idx)
            watched[1][seq_lens[i]] = (tree.tokens[i].tolist(), tree.scores[i].clone())
        return tree

    monkeypatch.setattr(EagleWorker, "draft", spy)

    def retracted(**hicache: Any) -> tuple[dict[str, Any], dict[int, Any], list[Any], list[Any], list[Any]]:
        with pd_pair(pair, monkeypatch, overlap=False, **hicache) as (prefill, decode, out):
            msgs = requests(setup["port"])
            decode.step(msgs)
            prefill.step(msgs)
            drive(prefill, decode, lambda: len(running(decode, 5)) == 2)
            live = running(decode)
            r0, table = live["r-0"], decode.req_to_token_pool.req_to_token
            keep = min(r0.kv_committed_len, len(r0.all_ids()) - 1)  # what the retraction keeps
            head = [buf for layer in decode.runner.draft_kv.layers for buf in layer]
            before = [buf[table[r0.req_pool_idx, :keep]].clone() for buf in head]
            extends: list[tuple[str, int]] = []
            restored: list[Any] = []
            launch = decode.worker.worker_batch

            def record(batch: Any) -> Any:
                if batch.forward_mode == ForwardMode.EXTEND:
                    extends.extend((r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens, strict=True))
                    restored.extend(buf[table[r0.req_pool_idx, :keep]].clone() for buf in head)
                return launch(batch)

            monkeypatch.setattr(decode.worker, "worker_batch", record)
            decode.preempt_running([r0], live["r-1"])
            watched[:] = [r0, {}]
            drive(prefill, decode, idle(prefill, decode))
        return tokens_of(out), watched[1], extends, before, restored

    tokens, trees, extends, before, restored = retracted(enable_hierarchical_cache=True, hicache_ratio=1.0)
    assert tokens == setup["expected"]
    assert extends == [("r-0", 1)], "the retracted request should resume from its host copy"
    assert all(a.equal(b) for a, b in zip(before, restored, strict=True))
    again, recomputed, extends, _, _ = retracted()
    assert again == tokens and sum(n for _, n in extends) > 1  # recomputed: its head's KV computed again
    common = trees.keys() & recomputed.keys()  # from the later of the two retractions (the transfers' timing)
    assert len(common) > 8
    for n in sorted(common):
        ids, scores = trees[n]
        assert ids == recomputed[n][0] and torch.allclose(scores, recomputed[n][1], rtol=1e-4, atol=1e-6), n
