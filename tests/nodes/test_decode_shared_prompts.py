"""``n > 1`` in P/D, in this process (prefill and decode roles, TCP transfer on 127.0.0.1): the choices of one request
(same prompt, seeds seed + i) are prefilled once and the decode node receives and holds the prompt's full pages once
(``HeldPrefixCache``): the first choice's pages land, the others lock them and receive only the prompt's last page.
Their tokens are the colocated node's for the same seeded requests, and the pools come back whole through every
release path: finish, an abort mid-stream, a retraction (recomputed on the decode node against the held pages) and
the transfer failure of the first choice while the others wait for its pages."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from common.config import ServerArgs
from common.engine.io_struct import AbortReq, GenerateReqInput, TokenOut
from common.engine.mem.held_prefix_cache import HeldPrefixCache
from common.engine.sampling.params import SamplingParams, for_choice
from common.engine.scheduler import Scheduler
from common.text.tokenizer import load_tokenizer
from tests.conftest import assert_scheduler_pools_released
from tests.model_fixtures import make_tiny_model

PAGE = 4
PROMPT = [(11 * j) % 900 + 10 for j in range(45)]  # 11 full pages shared, the 12th (1 token) each choice's own
SHARED = 44
N = 3
MAX_NEW = 40


def choice_params(i: int) -> SamplingParams:
    return for_choice(SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=1234, ignore_eos=True), i)


def requests(port: int) -> list[GenerateReqInput]:
    return [GenerateReqInput(rid=f"c-{i}", input_ids=list(PROMPT), sampling_params=choice_params(i),
                             bootstrap_room=5000 + i, bootstrap_addr=f"127.0.0.1:{port}") for i in range(N)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[dict[str, Any]]:
    from kvtransfer.bootstrap import BootstrapServer

    model = str(make_tiny_model("llama"))
    tokenizer = load_tokenizer(model)
    bootstrap = BootstrapServer("test-cluster-token")
    port = bootstrap.start()
    base = ServerArgs(model_path=model, page_size=PAGE, max_total_tokens=2048, max_running_requests=16,
                      chunked_prefill_size=16, disaggregation_bootstrap_port=port)
    expected = colocated_tokens(base, model, tokenizer, [
        GenerateReqInput(rid=f"c-{i}", input_ids=list(PROMPT), sampling_params=choice_params(i)) for i in range(N)])
    yield {"model": model, "tokenizer": tokenizer, "port": port, "base": base, "expected": expected}
    bootstrap.stop()


def colocated_tokens(args: ServerArgs, model: str, tokenizer: Any, msgs: list[GenerateReqInput],
                     timeout: float = 120) -> dict[str, list[int]]:
    """The tokens of ``msgs`` served together by one colocated scheduler: the P/D runs' reference."""
    out: list[Any] = []
    colocated = Scheduler(args, model, tokenizer, out.extend)
    try:
        colocated.step(msgs)
        deadline = time.monotonic() + timeout
        while not colocated.is_idle():
            assert time.monotonic() < deadline, f"the colocated run did not finish in {timeout} s"
            colocated.step([])
    finally:
        colocated.close()
    return tokens_of(out)


def tokens_of(outs: list[Any]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for m in outs:
        if isinstance(m, TokenOut):
            got.setdefault(m.rid, []).extend(m.token_ids)
    return got


def finals(outs: list[Any]) -> dict[str, TokenOut]:
    return {m.rid: m for m in outs if isinstance(m, TokenOut) and m.finish_reason is not None}


@contextlib.contextmanager
def pd_pair(setup: dict[str, Any], monkeypatch, overlap: bool = True, **decode_overrides: Any
            ) -> Iterator[tuple[Scheduler, Scheduler, list[Any]]]:
    from decode_node.role import DecodeRole
    from prefill_node.role import PrefillRole

    monkeypatch.setenv("PDCLUSTER_CLUSTER_TOKEN", "test-cluster-token")
    base = setup["base"].replace(disable_overlap_schedule=not overlap, enable_overlap_schedule=overlap)
    pargs = base.replace(disaggregation_mode="prefill")
    dargs = base.replace(disaggregation_mode="decode", **decode_overrides)
    decode_out: list[Any] = []
    prefill = Scheduler(pargs, setup["model"], setup["tokenizer"], lambda outs: None, role=PrefillRole(pargs))
    decode = Scheduler(dargs, setup["model"], setup["tokenizer"], decode_out.extend, role=DecodeRole(dargs))
    try:
        yield prefill, decode, decode_out
        # The decode node keeps no page nobody holds; a prefill node's radix cache may (evictable).
        assert decode.tree_cache.total_size() == 0, decode.tree_cache.pretty_print()
        assert decode.allocator.available_size() == decode.allocator.size
        assert_scheduler_pools_released(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def drive(prefill: Scheduler, decode: Scheduler, until: Callable[[], bool], timeout: float = 120,
          prefill_msgs: Callable[[], list[Any]] = list, decode_msgs: Callable[[], list[Any]] = list) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"condition not reached in {timeout} s"
        prefill.step(prefill_msgs())
        decode.step(decode_msgs())


def idle(prefill: Scheduler, decode: Scheduler) -> Callable[[], bool]:
    return lambda: prefill.is_idle() and decode.is_idle()


def running(decode: Scheduler, min_outputs: int = 1) -> dict[str, Any]:
    return {r.rid: r for r in decode.decode.running_batch.reqs if len(r.output_ids) >= min_outputs and not r.finished()}


def assert_shared(decode: Scheduler, reqs: list[Any], recomputed: bool = False) -> None:
    """The requests' rows point at the same slots for the prompt's full pages: one copy on the decode node (and,
    unless a retracted request's recomputed chunks joined it, nothing else in the cache)."""
    rows = decode.req_to_token_pool.req_to_token
    first = rows[reqs[0].req_pool_idx, :SHARED]
    for r in reqs[1:]:
        assert rows[r.req_pool_idx, :SHARED].equal(first), f"{r.rid} holds its own copy of the prompt"
        assert not rows[r.req_pool_idx, SHARED:len(PROMPT)].equal(rows[reqs[0].req_pool_idx, SHARED:len(PROMPT)])
    assert decode.tree_cache.protected_size() == SHARED or (recomputed and decode.tree_cache.protected_size() > SHARED)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_choices_receive_and_hold_the_prompt_once(setup, monkeypatch, overlap) -> None:
    with pd_pair(setup, monkeypatch, overlap) as (prefill, decode, out):
        assert isinstance(decode.tree_cache, HeldPrefixCache)
        msgs = requests(setup["port"])
        decode.step(msgs)
        prefill.step(msgs)
        seen_shared = False

        def check() -> bool:
            nonlocal seen_shared
            live = running(decode)
            if len(live) == N and not seen_shared:
                assert_shared(decode, list(live.values()))
                seen_shared = True
            return prefill.is_idle() and decode.is_idle()

        drive(prefill, decode, check)
        assert seen_shared, "the three choices never ran together"
        assert tokens_of(out) == setup["expected"]
        fin = finals(out)
        assert all(f.finish_reason == "length" for f in fin.values()), fin
        moved = sorted(f.timing.transfer_bytes for f in fin.values() if f.timing is not None)
        page_bytes = moved[0]
        assert moved == [page_bytes, page_bytes, page_bytes * (SHARED // PAGE + 1)], (
            "only the first choice's transfer should carry the prompt's full pages")


def test_abort_of_one_choice_mid_stream_keeps_the_others_pages(setup, monkeypatch) -> None:
    with pd_pair(setup, monkeypatch) as (prefill, decode, out):
        msgs = requests(setup["port"])
        decode.step(msgs)
        prefill.step(msgs)
        drive(prefill, decode, lambda: len(running(decode, 3)) == N)
        assert_shared(decode, list(running(decode).values()))
        assert len(running(decode)["c-0"].output_ids) < MAX_NEW - 2
        abort = [AbortReq(rid="c-0", reason="client went away")]  # the choice whose pages were inserted first
        prefill.step(abort)
        decode.step(abort)
        drive(prefill, decode, idle(prefill, decode))
        fin = finals(out)
        assert fin["c-0"].finish_reason == "abort"
        got, expected = tokens_of(out), setup["expected"]
        assert got["c-0"] == expected["c-0"][: len(got["c-0"])]
        for rid in ("c-1", "c-2"):
            assert fin[rid].finish_reason == "length" and got[rid] == expected[rid], rid


def test_retracted_choices_recompute_against_the_held_pages(setup, monkeypatch) -> None:
    with pd_pair(setup, monkeypatch) as (prefill, decode, out):
        msgs = requests(setup["port"])
        decode.step(msgs)
        prefill.step(msgs)
        drive(prefill, decode, lambda: len(running(decode, 3)) == N)
        live = running(decode)
        victims = [live["c-0"], live["c-1"]]  # the first lander and another: c-2 alone holds the prompt after
        decode.preempt_running(victims, live["c-2"])
        assert decode.tree_cache.protected_size() == SHARED
        seen_rematch = False

        def check() -> bool:
            nonlocal seen_rematch
            back = running(decode)
            if not seen_rematch and all(v.rid in back for v in victims) and "c-2" in back:
                assert_shared(decode, [back["c-2"], back["c-0"], back["c-1"]], recomputed=True)
                seen_rematch = True
            return prefill.is_idle() and decode.is_idle()

        drive(prefill, decode, check)
        assert decode.prefill.policy.num_preempted == 2 and seen_rematch
        fin = finals(out)
        assert all(f.finish_reason == "length" for f in fin.values()), fin
        assert tokens_of(out) == setup["expected"]


def test_first_choice_transfer_failure_hands_the_prompt_to_a_waiting_one(setup, monkeypatch) -> None:
    with pd_pair(setup, monkeypatch) as (prefill, decode, out):
        msgs = requests(setup["port"])
        decode.step(msgs)
        role = decode.role
        drive(prefill, decode, lambda: bool(role.transfer_queue.queue))
        assert [r.rid for r in role.transfer_queue.queue] == ["c-0"]
        assert sorted(r.rid for r in role.prealloc_queue.queue) == ["c-1", "c-2"], "the others must wait for c-0"
        for _ in range(5):  # they keep waiting while c-0's KV is in transit
            decode.step([])
        assert sorted(r.rid for r in role.prealloc_queue.queue) == ["c-1", "c-2"]
        prefill.step([*msgs, AbortReq(rid="c-0", reason="prefill gave up")])  # c-0's transfer fails
        drive(prefill, decode, idle(prefill, decode))
        fin = finals(out)
        assert fin["c-0"].finish_reason == "abort"
        got, expected = tokens_of(out), setup["expected"]
        for rid in ("c-1", "c-2"):
            assert fin[rid].finish_reason == "length" and got[rid] == expected[rid], rid
        moved = sorted(fin[rid].timing.transfer_bytes for rid in ("c-1", "c-2"))  # type: ignore[union-attr]
        assert moved[1] == moved[0] * (SHARED // PAGE + 1), "the second lander should share the first's pages"


def test_disable_radix_cache_gives_each_choice_its_own_copy(setup, monkeypatch) -> None:
    with pd_pair(setup, monkeypatch, disable_radix_cache=True) as (prefill, decode, out):
        assert not isinstance(decode.tree_cache, HeldPrefixCache)
        msgs = requests(setup["port"])
        decode.step(msgs)
        prefill.step(msgs)
        drive(prefill, decode, idle(prefill, decode))
        assert tokens_of(out) == setup["expected"]
        moved = {f.timing.transfer_bytes for f in finals(out).values() if f.timing is not None}
        assert len(moved) == 1, moved


def test_a_choice_waits_for_the_prompt_half_a_bootstrap_timeout_at_most(setup, monkeypatch) -> None:
    """A choice waits for the first one's pages no longer than half its prefill peer's wait for destination pages:
    then it receives the prompt whole, and its copy is folded into the held one when it lands."""
    with pd_pair(setup, monkeypatch, bootstrap_timeout=1.0) as (prefill, decode, out):
        msgs = requests(setup["port"])
        decode.step(msgs)
        role = decode.role
        drive(prefill, decode, lambda: bool(role.transfer_queue.queue), prefill_msgs=lambda: [])
        assert len(role.prealloc_queue.queue) == N - 1  # waiting for c-0's pages: no prefill runs c-0 yet
        arrived = max(r.times.arrival for r in role.prealloc_queue.queue)
        deadline = time.monotonic() + 10
        while len(role.transfer_queue.queue) < N:
            assert time.monotonic() < deadline, "the waiting choices never stopped waiting"
            decode.step([])
            time.sleep(0.01)
        assert time.monotonic() - arrived >= 0.5, "they stopped waiting before half the bootstrap timeout"
        prefill.step(msgs)
        seen_shared = False

        def check() -> bool:
            nonlocal seen_shared
            live = running(decode)
            if len(live) == N and not seen_shared:
                assert_shared(decode, list(live.values()))
                seen_shared = True
            return prefill.is_idle() and decode.is_idle()

        drive(prefill, decode, check)
        assert seen_shared and tokens_of(out) == setup["expected"]
        moved = {f.timing.transfer_bytes for f in finals(out).values() if f.timing is not None}
        assert len(moved) == 1, moved  # each received the prompt whole
