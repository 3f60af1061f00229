"""Speculation through P/D on one GPU: a prefill and a decode scheduler in this process, CUDA pools, TCP transfer on
127.0.0.1, the prefill node on the overlap schedule (a GPU node's default), the decode node's steps as CUDA graphs
(verify, draft, draft extend). STANDALONE (the target as its own draft): the draft's KV arrives with the target's
(the decode node's draft extends over no prompt position) and the tokens equal a colocated speculating engine's on
the GPU; EAGLE3: the decode node drafts from its first step the trees a colocated node drafts. Pools back on both
nodes. CPU twins: tests/nodes/test_standalone_pd.py, tests/nodes/test_eagle_pd.py."""

from __future__ import annotations

import torch

from common.engine.io_struct import GenerateReqInput
from common.engine.spec.eagle_worker import EagleWorker
from tests.engine.test_eagle_head import head_dir
from tests.engine.test_spec_decode import greedy, run
from tests.model_fixtures import make_tiny_model
from tests.nodes.test_eagle_pd import EAGLE3, _recording, _serve_pd, bootstrap_port  # noqa: F401  (a fixture)
from tests.nodes.test_eagle_pd import PROMPTS as EAGLE_PROMPTS
from tests.nodes.test_standalone_pd import NEW, PREFILL_OVERLAP, PROMPTS, serve_pd, setup, standalone  # noqa: F401

CUDA = {"device": "cuda"}


def test_standalone_pd_on_cuda_with_the_prefill_node_overlapped(setup, monkeypatch) -> None:  # noqa: F811
    spec = {**standalone(setup["model"]), **CUDA}
    reqs = [GenerateReqInput(rid=r, input_ids=p, sampling_params=greedy(NEW)) for r, p in PROMPTS.items()]
    colocated, _ = run(setup["model"], reqs, spec, page_size=16, chunked_prefill_size=16, steps_between=40)
    ids, ends, prompt_positions = serve_pd(setup, monkeypatch, {**spec, **PREFILL_OVERLAP}, spec, 16, 9700)
    assert ids == colocated.ids
    assert prompt_positions == 0  # the draft KV of every prompt position came with the transfer
    assert ends["c"].cached_tokens == 32  # "a"'s prefix and its draft KV from the prefill node's radix cache
    drafted = sum(f.spec_draft_tokens for f in ends.values())
    accepted = sum(f.spec_accepted_tokens for f in ends.values())
    # the draft is the target: with its KV right nearly every draft is accepted (a verify's and a decode step's
    # kernels differ, so a near-tie may flip one); a garbage draft KV accepts few
    assert drafted > 0 and accepted >= 0.9 * drafted, (accepted, drafted)


def test_eagle3_pd_on_cuda_drafts_from_the_first_step_what_a_colocated_node_drafts(bootstrap_port,  # noqa: F811
                                                                                   monkeypatch) -> None:
    model = str(make_tiny_model("llama"))
    reqs = [GenerateReqInput(rid=r, input_ids=p, sampling_params=greedy(12)) for r, p in EAGLE_PROMPTS.items()]
    spec = {**EAGLE3, "speculative_draft_model_path": str(head_dir("EAGLE3"))}
    colocated: dict[tuple[int, ...], object] = {}
    monkeypatch.setattr(EagleWorker, "draft", _recording(colocated))
    colo, _ = run(model, reqs, spec, page_size=16, chunked_prefill_size=32, steps_between=40, **CUDA)
    pd: dict[tuple[int, ...], object] = {}
    monkeypatch.setattr(EagleWorker, "draft", _recording(pd))
    ids, finals = _serve_pd(model, bootstrap_port, monkeypatch, prefill_overlap=True, **CUDA)
    assert ids == colo.ids
    assert {(len(p),) for p in EAGLE_PROMPTS.values()} <= pd.keys()  # the first decode step drafted
    for key in pd.keys() & colocated.keys():
        (tokens, scores), (want_tokens, want_scores) = pd[key], colocated[key]  # type: ignore[misc]
        assert tokens == want_tokens, key
        assert torch.allclose(scores, want_scores, rtol=1e-4, atol=1e-6), key
    assert all(f.spec_draft_tokens > 0 for f in finals.values())
