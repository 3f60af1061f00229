"""A decode node's host tier (``HiHeldPrefixCache``), in this process (prefill and decode roles, TCP transfer on
127.0.0.1, the overlap schedule on): a request retracted mid-decode keeps its KV on the host and resumes from it —
one token extended, not its whole sequence recomputed — with the colocated node's tokens; the device and host pools
come back whole (``pd_pair``). A restore whose copy hangs is given up at --hicache-load-timeout: the request is
recomputed, with the same tokens, and the restore's pages are free again while the copy still hangs. With STANDALONE speculation (the overlap schedule off) the host copy keeps the
draft's KV too."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

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


@pytest.mark.parametrize("hang", [False, True], ids=["restored", "restore-hangs"])
def test_a_retracted_decode_request_resumes_from_its_host_copy(setup, monkeypatch, hang) -> None:
    """hang: the restore's copy hangs; past --hicache-load-timeout the request is recomputed instead (the same
    tokens) while the copy still hangs, its pages free again (it is cancelled: it never writes them)."""
    from common.engine.mem.hicache.copy_engine import CopyEngine

    release, copy = threading.Event(), CopyEngine._copy_pages

    def hanging(self: CopyEngine, job: Any) -> Any:
        if job.kind == "load" and hang:
            release.wait(20)  # bounded: without the deadline the request waits this long, then is restored
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
            if not hang:
                assert extends == [("r-0", 1)], "the retracted request should resume from its host copy"
                assert decode.tree_cache.hicache_report().load_bytes > 0
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
