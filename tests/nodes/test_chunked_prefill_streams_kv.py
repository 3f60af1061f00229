"""Chunked prefill streams its KV: the decode node holds the first chunk's KV before the prefill node has run the
prompt's last chunk (prefill and decode roles in this process, TCP transfer on 127.0.0.1, overlap off)."""

from __future__ import annotations

import time
from typing import Any

import torch

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput, PrefillDone, TokenOut
from common.engine.sampling.params import SamplingParams
from common.engine.scheduler import Scheduler
from tests.conftest import assert_scheduler_pools_released

CHUNK = 16
PROMPT = [(11 * j) % 900 + 10 for j in range(4 * CHUNK + 5)]  # five chunks
DEADLINE_S = 120.0  # the whole request
FIRST_CHUNK_S = 30.0  # the first chunk's KV on the decode node, once sent


def kv_of(sched: Any, req: Any, n: int) -> list[torch.Tensor]:
    """K and V of every layer at the first ``n`` positions of ``req``."""
    slots = sched.req_to_token_pool.req_to_token[req.req_pool_idx, :n].long()
    pool = sched.runner.kv_pool
    return [buf[slots].clone() for layer in range(pool.num_layers) for buf in (pool.k_buffer[layer], pool.v_buffer[layer])]


def test_decode_holds_the_first_chunks_kv_before_the_last_chunk_runs(pd_bootstrap) -> None:
    from decode_node.role import DecodeRole
    from prefill_node.role import PrefillRole

    model, tokenizer, port = pd_bootstrap
    base = ServerArgs(model_path=model, page_size=4, max_total_tokens=2048, max_running_requests=8,
                      chunked_prefill_size=CHUNK, disaggregation_bootstrap_port=port, disable_overlap_schedule=True)
    prefill_out: list[Any] = []
    decode_out: list[Any] = []
    pargs, dargs = base.replace(disaggregation_mode="prefill"), base.replace(disaggregation_mode="decode")
    prefill = Scheduler(pargs, model, tokenizer, prefill_out.extend, role=PrefillRole(pargs))
    decode = Scheduler(dargs, model, tokenizer, decode_out.extend, role=DecodeRole(dargs))
    try:
        msg = GenerateReqInput(rid="long", input_ids=PROMPT, bootstrap_room=77, bootstrap_addr=f"127.0.0.1:{port}",
                               sampling_params=SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        decode.step([msg])
        prefill.step([msg])
        deadline = time.monotonic() + DEADLINE_S
        # Run the prefill node until its second chunk has run: the first chunk's pages were handed to the transfer
        # when the second was scheduled; three chunks are still to come.
        while (p_req := prefill.intake.reqs_by_rid.get("long")) is None or p_req.kv_committed_len < 2 * CHUNK:
            assert time.monotonic() < deadline, "the prefill node did not run two chunks"
            decode.step([])
            prefill.step([])
        assert p_req.kv_committed_len == 2 * CHUNK and p_req.output_ids == []
        d_req = decode.intake.reqs_by_rid["long"]
        expected = kv_of(prefill, p_req, CHUNK)
        first_chunk_deadline = time.monotonic() + FIRST_CHUNK_S
        assert all(t.abs().sum() > 0 for t in expected)  # the decode pool starts zeroed
        while not all(torch.equal(a, b) for a, b in zip(kv_of(decode, d_req, CHUNK), expected, strict=True)):
            assert time.monotonic() < first_chunk_deadline, (
                "the decode node did not receive the first chunk's KV while the prefill node held its last chunk")
            decode.step([])
            time.sleep(0.01)
        assert p_req.kv_committed_len == 2 * CHUNK and p_req.output_ids == [], "the prefill node ran on"

        while not (prefill.is_idle() and decode.is_idle()):
            assert time.monotonic() < deadline, "the request did not finish"
            prefill.step([])
            decode.step([])
        done = [m for m in prefill_out if isinstance(m, PrefillDone)]
        assert len(done) == 1 and done[0].error is None
        tokens = [t for m in decode_out if isinstance(m, TokenOut) for t in m.token_ids]
        assert len(tokens) == 4
        assert_scheduler_pools_released(prefill, decode)
    finally:
        prefill.close()
        decode.close()
