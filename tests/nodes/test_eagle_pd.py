"""EAGLE through P/D, in this process (prefill and decode roles, TCP transfer on 127.0.0.1): the prefill node runs
the draft head over the prompt and sends its KV layer with the target's and its state with the metadata, so the
decode node drafts from its first step exactly what a colocated node drafts; tokens as without speculation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from common.config import ServerArgs
from common.engine.io_struct import GenerateReqInput, TokenOut
from common.engine.scheduler import Scheduler
from common.engine.spec.eagle_worker import EagleWorker
from common.text.tokenizer import load_tokenizer
from tests.conftest import assert_scheduler_pools_released
from tests.engine.test_eagle_head import head_dir
from tests.engine.test_spec_decode import greedy, prompt, run
from tests.model_fixtures import make_tiny_model
from tests.nodes.test_decode_shared_prompts import drive, finals, idle, tokens_of

CLUSTER_TOKEN = "test-cluster-token"
DRAFT = EagleWorker.draft
PROMPTS = {"a": prompt(37, 3), "b": prompt(20, 4)}
EAGLE3 = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 2, "speculative_eagle_topk": 2,
          "speculative_num_draft_tokens": 4}


@pytest.fixture(scope="module")
def bootstrap_port() -> Iterator[int]:
    from kvtransfer.bootstrap import BootstrapServer

    server = BootstrapServer(CLUSTER_TOKEN)
    port = server.start()
    try:
        yield port
    finally:
        server.stop()


def _recording(drafts: dict[tuple[int, ...], Any]):
    """``EagleWorker.draft`` that keeps each tree's tokens and path scores by the requests' committed lengths."""

    def wrapped(self, state, verified, req_pool_indices, seq_lens, req_to_token):
        tree = DRAFT(self, state, verified, req_pool_indices, seq_lens, req_to_token)
        drafts[tuple(seq_lens)] = (tree.tokens.tolist(), tree.scores)
        return tree

    return wrapped


def _serve_pd(model: str, port: int, monkeypatch, prefill_overlap: bool = False, **node: Any
              ) -> tuple[dict[str, list[int]], dict[str, TokenOut]]:
    """``PROMPTS`` one at a time through a prefill and a decode scheduler (both with ``node``'s flags too)."""
    from decode_node.role import DecodeRole
    from prefill_node.role import PrefillRole

    monkeypatch.setenv("PDCLUSTER_CLUSTER_TOKEN", CLUSTER_TOKEN)
    spec = {**EAGLE3, "speculative_draft_model_path": str(head_dir("EAGLE3"))}
    base = ServerArgs(model_path=model, page_size=16, max_total_tokens=2048, max_running_requests=8,
                      chunked_prefill_size=32, disaggregation_bootstrap_port=port, disable_overlap_schedule=True,
                      **spec, **node)
    overlap = {"disable_overlap_schedule": False, "enable_overlap_schedule": True} if prefill_overlap else {}
    pargs, dargs = base.replace(disaggregation_mode="prefill", **overlap), base.replace(disaggregation_mode="decode")
    tokenizer = load_tokenizer(model)
    out: list[Any] = []
    prefill = Scheduler(pargs, model, tokenizer, lambda outs: None, role=PrefillRole(pargs))
    decode = Scheduler(dargs, model, tokenizer, out.extend, role=DecodeRole(dargs))
    assert prefill.overlap is prefill_overlap and not decode.overlap
    try:
        for i, (rid, ids) in enumerate(PROMPTS.items()):  # one at a time: every forward as in the colocated run
            msg = GenerateReqInput(rid=rid, input_ids=ids, sampling_params=greedy(12), bootstrap_room=8000 + i,
                                   bootstrap_addr=f"127.0.0.1:{port}")
            decode.step([msg])
            prefill.step([msg])
            drive(prefill, decode, idle(prefill, decode))
        assert_scheduler_pools_released(prefill, decode)
    finally:
        prefill.close()
        decode.close()
    return tokens_of(out), finals(out)


@pytest.mark.parametrize("prefill_overlap", [False, True], ids=["inline", "overlap"])
def test_a_decode_node_drafts_from_its_first_step_what_a_colocated_node_drafts(bootstrap_port, monkeypatch,
                                                                               prefill_overlap) -> None:
    """With ``prefill_overlap`` the prefill node runs the overlap schedule (forced on CPU): the head's extend and its
    state's read for the metadata run on the forward thread in launch order, so the same KV and state arrive."""
    model = str(make_tiny_model("llama"))
    reqs = [GenerateReqInput(rid=r, input_ids=p, sampling_params=greedy(12)) for r, p in PROMPTS.items()]
    plain, _ = run(model, reqs)
    spec = {**EAGLE3, "speculative_draft_model_path": str(head_dir("EAGLE3"))}
    colocated: dict[tuple[int, ...], Any] = {}
    monkeypatch.setattr(EagleWorker, "draft", _recording(colocated))
    colo, _ = run(model, reqs, spec, page_size=16, chunked_prefill_size=32, steps_between=40)  # one at a time
    pd: dict[tuple[int, ...], Any] = {}
    monkeypatch.setattr(EagleWorker, "draft", _recording(pd))
    ids, finals = _serve_pd(model, bootstrap_port, monkeypatch, prefill_overlap)
    assert colo.ids == plain.ids and ids == plain.ids
    assert {(len(p),) for p in PROMPTS.values()} <= pd.keys()  # the first decode step drafted
    assert pd.keys() == colocated.keys()
    for key, (tokens, scores) in pd.items():  # the head's state and its KV over the prompt came with the transfer
        assert tokens == colocated[key][0], key
        assert torch.allclose(scores, colocated[key][1], rtol=1e-5, atol=0), key
    assert all(f.spec_draft_tokens > 0 for f in finals.values())
    assert {r: (f.spec_draft_tokens, f.spec_accepted_tokens) for r, f in finals.items()} == {
        r: (f.spec_draft_tokens, f.spec_accepted_tokens) for r, f in colo.final.items()}  # acceptance alike


def test_metadata_carries_the_draft_state_and_refuses_another_shape() -> None:
    import numpy as np

    from kvtransfer.metadata import MetadataBuffers, MetadataRecord

    hidden = np.arange(6, dtype="<f4").tobytes()
    rec = MetadataRecord(room=5, first_token=9, draft_topk_ids=(3, 7), draft_topk_p=(0.5, 0.25), draft_hidden=hidden)
    buffers = MetadataBuffers(4, (2, 6))
    buffers.write(1, rec)
    assert buffers.read(1) == rec
    buffers.write(2, MetadataRecord(room=6, first_token=1))  # a record without a draft state stays valid
    assert buffers.read(2).draft_topk_ids == () and buffers.read(2).draft_hidden == b""
    with pytest.raises(ValueError, match="top-2 and hidden 6, this node holds top-2 and hidden 5"):
        MetadataBuffers(4, (2, 5)).write(0, rec)
    with pytest.raises(ValueError, match="this node holds top-0"):
        MetadataBuffers(4).write(0, rec)


def test_up_gives_prefill_nodes_eagles_flags_and_no_others(tmp_path) -> None:
    from common.app.cli import build_parser
    from common.app.up import LocalCluster
    from common.config import server_args_from_cli

    def prefill_args(*spec: str) -> ServerArgs:
        argv = ["up", "--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path), *spec]
        cluster = LocalCluster(build_parser().parse_args(argv))
        return server_args_from_cli(build_parser().parse_args(cluster.node_args("prefill-0", port=5002,
                                                                                bootstrap=5001)))

    eagle = prefill_args("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                         str(head_dir("EAGLE3")), "--speculative-eagle-topk", "2")
    assert (eagle.speculative_algorithm, eagle.speculative_eagle_topk) == ("EAGLE3", 2)
    assert prefill_args("--speculative-algorithm", "NGRAM").speculative_algorithm is None
