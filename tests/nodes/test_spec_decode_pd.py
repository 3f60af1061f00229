"""Speculative decoding on a decode node, in this process (prefill and decode roles, TCP transfer on 127.0.0.1): the
decode node speculates from the first step after a transfer (NGRAM from the prompt that came with the request;
STANDALONE from its draft model's prompt KV, which the prefill node computed and sent with the target's) and its
tokens are the colocated node's without speculation, through the ``n > 1`` prompt pages the decode node holds once
and a retraction mid-stream (recomputed on the decode node, the draft model's KV with it); the pools, the draft
model's included, come back whole."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput, TokenOut
from common.engine.scheduler import Scheduler
from common.text.tokenizer import load_tokenizer
from tests.conftest import assert_scheduler_pools_released
from tests.engine.test_spec_decode import greedy, prompt, run
from tests.model_fixtures import make_copy_model, make_tiny_model
from tests.nodes.test_decode_shared_prompts import finals, tokens_of

CLUSTER_TOKEN = "test-cluster-token"
NGRAM = {"speculative_algorithm": "NGRAM"}


@pytest.fixture(scope="module")
def setup() -> Iterator[dict[str, Any]]:
    """The copy model, requests (one holding the model's cycle with every 5th token changed, twice: n > 1), their
    colocated plain outputs and a bootstrap server."""
    from kvtransfer.bootstrap import BootstrapServer

    model = str(make_copy_model())
    first, _ = run(model, [GenerateReqInput(rid="seed", input_ids=prompt(20, 1), sampling_params=greedy(60))])
    noisy = prompt(9, 2) + [t + 1 if j % 5 == 2 else t for j, t in enumerate(first.ids["seed"][:50])]
    prompts = {"fresh": prompt(30, 3), "noisy": noisy, "twin": noisy}  # its drafts: some accepted, some rejected
    plain, _ = run(model, [GenerateReqInput(rid=r, input_ids=p, sampling_params=greedy()) for r, p in prompts.items()])
    bootstrap = BootstrapServer(CLUSTER_TOKEN)
    port = bootstrap.start()
    try:
        yield {"model": model, "prompts": prompts, "expected": plain.ids, "port": port}
    finally:
        bootstrap.stop()


def serve_pd(setup: dict[str, Any], monkeypatch, spec: dict[str, Any], page_size: int, retract: bool
             ) -> tuple[dict[str, list[int]], dict[str, TokenOut]]:
    from decode_node.role import DecodeRole
    from prefill_node.role import PrefillRole

    monkeypatch.setenv("PDCLUSTER_CLUSTER_TOKEN", CLUSTER_TOKEN)
    model, port = setup["model"], setup["port"]
    base = ServerArgs(model_path=model, page_size=page_size, max_total_tokens=2048, max_running_requests=16,
                      chunked_prefill_size=32, disaggregation_bootstrap_port=port, disable_overlap_schedule=True)
    drafts = spec if spec["speculative_algorithm"] == "STANDALONE" else {}  # its draft runs on both nodes
    pargs = base.replace(disaggregation_mode="prefill", **drafts)
    dargs = base.replace(disaggregation_mode="decode", **spec)
    tokenizer = load_tokenizer(model)
    out: list[Any] = []
    prefill = Scheduler(pargs, model, tokenizer, lambda outs: None, role=PrefillRole(pargs))
    decode = Scheduler(dargs, model, tokenizer, out.extend, role=DecodeRole(dargs))
    try:
        msgs = [GenerateReqInput(rid=r, input_ids=p, sampling_params=greedy(), bootstrap_room=7000 + i,
                                 bootstrap_addr=f"127.0.0.1:{port}") for i, (r, p) in enumerate(setup["prompts"].items())]
        decode.step(msgs)
        prefill.step(msgs)
        deadline = time.monotonic() + 120
        retracted = not retract
        while not (prefill.is_idle() and decode.is_idle()):
            assert time.monotonic() < deadline, "P/D pair did not finish in 120 s"
            prefill.step([])
            decode.step([])
            live = {r.rid: r for r in decode.decode.running_batch.reqs if not r.finished()}
            if not retracted and "noisy" in live and len(live["noisy"].output_ids) >= 12 and "fresh" in live:
                decode.preempt_running([live["noisy"]], live["fresh"])  # recomputed on the decode node
                retracted = True
        assert retracted and decode.prefill.policy.num_preempted == (1 if retract else 0)
        assert_scheduler_pools_released(prefill, decode)
        drafter = decode.decode.speculator.drafter if decode.decode.speculator is not None else None
        if hasattr(drafter, "allocator"):
            assert drafter.allocator.available_size() == drafter.allocator.size
    finally:
        prefill.close()
        decode.close()
    return tokens_of(out), finals(out)


@pytest.mark.parametrize(("spec", "page_size", "retract"), [
    (NGRAM, 1, False),
    (NGRAM, 16, True),
    ({"speculative_algorithm": "STANDALONE", "speculative_num_steps": 4,
      "speculative_draft_model_path": "tiny"}, 16, True),
], ids=["ngram-page1", "ngram-page16-retract", "standalone-page16-retract"])
def test_a_speculating_decode_node_emits_the_colocated_tokens(setup, monkeypatch, spec, page_size, retract) -> None:
    if spec.get("speculative_draft_model_path") == "tiny":  # a draft that disagrees with the copy model
        spec = {**spec, "speculative_draft_model_path": str(make_tiny_model("llama"))}
    ids, finals = serve_pd(setup, monkeypatch, spec, page_size, retract)
    assert ids == setup["expected"]
    assert all(f.finish_reason == "length" for f in finals.values())
    assert sum(f.spec_draft_tokens for f in finals.values()) > 0
    if spec["speculative_algorithm"] == "NGRAM":
        assert finals["twin"].spec_accepted_tokens > 0  # drafted from the prompt that came with the transfer
