"""The prefill and decode roles in the one engine loop, in this process (TCP transfer on 127.0.0.1): chunked prompts,
an abort between two chunks and an internal error on the prefill node, with the overlap schedule on and off."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

import common.faults as faults
from common.config import ServerArgs
from common.engine.io_struct import AbortReq, GenerateReqInput, PrefillDone, TokenOut
from common.engine.sampling.params import SamplingParams
from common.engine.scheduler import Scheduler
from common.errors import ErrorCode
from tests.conftest import assert_scheduler_pools_released

PROMPT_LENGTHS = [5, 17, 40, 63, 3, 100]  # chunks of 16: one to seven per prompt


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def run(step: Callable[[list[Any]], Any], idle: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not idle():
        assert time.monotonic() < deadline, f"not idle after {timeout} s"
        step([])


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_pd_roles_match_colocated_through_chunk_aborts_and_internal_errors(
    overlap, monkeypatch, pd_bootstrap
) -> None:
    from decode_node.role import DecodeRole
    from prefill_node.role import PrefillRole

    monkeypatch.setattr(faults, "_FAULTS", {"token": frozenset({"fault"})})
    model, tokenizer, port = pd_bootstrap
    base = ServerArgs(model_path=model, page_size=4, max_total_tokens=4096, max_running_requests=16,
                      chunked_prefill_size=16, disaggregation_bootstrap_port=port,
                      disable_overlap_schedule=not overlap, enable_overlap_schedule=overlap)
    prompts = {f"r{i}": [(7 * i + 3 * j) % 900 + 10 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)}

    colocated_out: list[Any] = []
    colocated = Scheduler(base, model, tokenizer, colocated_out.extend)
    try:
        colocated.step([GenerateReqInput(rid=r, input_ids=p, sampling_params=greedy(8)) for r, p in prompts.items()])
        run(colocated.step, colocated.is_idle)
    finally:
        colocated.close()
    expected: dict[str, list[int]] = {}
    for m in colocated_out:
        if isinstance(m, TokenOut):
            expected.setdefault(m.rid, []).extend(m.token_ids)

    prefill_out: list[Any] = []
    decode_out: list[Any] = []
    pargs, dargs = base.replace(disaggregation_mode="prefill"), base.replace(disaggregation_mode="decode")
    prefill = Scheduler(pargs, model, tokenizer, prefill_out.extend, role=PrefillRole(pargs))
    decode = Scheduler(dargs, model, tokenizer, decode_out.extend, role=DecodeRole(dargs))
    try:
        extra = {"fault": list(range(20, 32)), "abort": list(range(20, 110))}  # "abort": six chunks
        msgs = [GenerateReqInput(rid=r, input_ids=p, sampling_params=greedy(8), bootstrap_room=1000 + i,
                                 bootstrap_addr=f"127.0.0.1:{port}")
                for i, (r, p) in enumerate({**prompts, **extra}.items())]
        decode.step(msgs)
        prefill.step(msgs)
        deadline = time.monotonic() + 120
        aborted_mid_chunk = False
        while not (prefill.is_idle() and decode.is_idle()):
            assert time.monotonic() < deadline, "the PD pair did not finish in 120 s"
            chunked = prefill.prefill.chunked_req
            abort = [] if aborted_mid_chunk or chunked is None or chunked.rid != "abort" else [
                AbortReq(rid="abort", reason="client went away")]
            aborted_mid_chunk |= bool(abort)
            prefill.step(abort)
            decode.step(abort)
        assert aborted_mid_chunk

        got: dict[str, list[int]] = {}
        finished: dict[str, TokenOut] = {}
        for m in decode_out:
            if isinstance(m, TokenOut):
                got.setdefault(m.rid, []).extend(m.token_ids)
                if m.finish_reason is not None:
                    finished[m.rid] = m
        done = {m.rid: m for m in prefill_out if isinstance(m, PrefillDone)}
        for rid in prompts:
            assert got[rid] == expected[rid], rid
            assert done[rid].error is None and finished[rid].finish_reason == "length"
        assert done["abort"].error_code == finished["abort"].error_code == ErrorCode.CANCELLED
        assert done["fault"].error_code == finished["fault"].error_code == ErrorCode.INTERNAL
        assert "injected token fault" in (done["fault"].error or "")
        assert_scheduler_pools_released(prefill, decode)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_a_transferred_requests_first_token_goes_out_before_the_decode_step_it_joins(
    overlap, monkeypatch, pd_bootstrap
) -> None:
    """The prefill node's first token is the client's TTFT: it leaves the decode rank in the step its transfer landed,
    not after that step's forward (one decode step later)."""
    from decode_node.role import DecodeRole
    from prefill_node.role import PrefillRole

    model, tokenizer, port = pd_bootstrap
    base = ServerArgs(model_path=model, page_size=4, max_total_tokens=4096, max_running_requests=16,
                      chunked_prefill_size=64, disaggregation_bootstrap_port=port,
                      disable_overlap_schedule=not overlap, enable_overlap_schedule=overlap)
    log: list[tuple[str, set[str]]] = []  # ("out", rids with tokens) and ("forward", rids in the batch), in order
    pargs, dargs = base.replace(disaggregation_mode="prefill"), base.replace(disaggregation_mode="decode")
    prefill = Scheduler(pargs, model, tokenizer, lambda _msgs: None, role=PrefillRole(pargs))
    decode = Scheduler(dargs, model, tokenizer,
                       lambda msgs: log.append(("out", {m.rid for m in msgs if isinstance(m, TokenOut) and m.token_ids})),
                       role=DecodeRole(dargs))
    owner, name = (decode.worker, "launch") if overlap else (decode, "run_batch")
    forward = getattr(owner, name)

    def logged(batch: Any) -> Any:
        log.append(("forward", {r.rid for r in batch.reqs}))
        return forward(batch)

    monkeypatch.setattr(owner, name, logged)
    try:
        msgs = [GenerateReqInput(rid=f"r{i}", input_ids=[(5 * i + j) % 900 + 10 for j in range(9 + 7 * i)],
                                 sampling_params=greedy(4), bootstrap_room=2000 + i, bootstrap_addr=f"127.0.0.1:{port}")
                for i in range(4)]
        decode.step(msgs)
        prefill.step(msgs)
        run(lambda m: (prefill.step(m), decode.step(m)), lambda: prefill.is_idle() and decode.is_idle())
        for msg in msgs:
            first_out = next(i for i, (kind, rids) in enumerate(log) if kind == "out" and msg.rid in rids)
            first_forward = next(i for i, (kind, rids) in enumerate(log) if kind == "forward" and msg.rid in rids)
            assert first_out < first_forward, (msg.rid, log)
        assert_scheduler_pools_released(prefill, decode)
    finally:
        prefill.close()
        decode.close()
