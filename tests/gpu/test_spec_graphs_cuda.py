"""Speculation's steps replayed as CUDA graphs (triton attention, fp32) against eager speculation on the same GPU:
the verify forwards (``VerifyGraphRunner``, chains and an EAGLE3 tree with its captured streams), EAGLE's draft
steps (``DraftGraphRunner``), the STANDALONE draft model's and the target's decode steps (``DecodeGraphRunner``),
the decode-time draft extends of the EAGLE3 head (``EagleExtendGraphRunner``) and of the STANDALONE draft
(``DraftExtendGraphRunner``, 2 rows per request after each full accept, padded to bucket 4).

Per algorithm: every runner passed its start-up check and serves as CUDA graphs (not fallen back), every replayed
step's logits / features within 1e-4 of the eager forward of the same batch, a padded bucket among them (3
requests in bucket 4), greedy output equal to an engine with --disable-cuda-graph; pools back (``run``).
Skipped without CUDA (tests/gpu/conftest.py); CPU twin (compiled steps): tests/engine/test_spec_graphs.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from common.engine.spec.ngram import NgramDrafter
from tests.engine.test_eagle_head import head_dir
from tests.engine.test_spec_decode import run
from tests.engine.test_spec_graphs import StepLog, _reqs, _scripted_ngram
from tests.model_fixtures import make_tiny_model

ATOL = 1e-4
CUDA = {"device": "cuda", "max_running_requests": 4}


def _spec(algo: str) -> dict[str, Any]:
    tiny = str(make_tiny_model("llama"))
    if algo == "NGRAM":
        return {"speculative_algorithm": "NGRAM", "speculative_num_steps": 4}
    if algo == "STANDALONE":  # the target as its own draft: every draft accepted
        return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": tiny,
                "speculative_num_steps": 3}
    return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head_dir("EAGLE3")),
            "speculative_num_steps": 3, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "EAGLE3"])
def test_spec_steps_replayed_as_cuda_graphs_match_eager(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = str(make_tiny_model("llama"))
    reqs = _reqs()
    if algo == "NGRAM":  # drafts of the plain output (the tiny model's own output never repeats)
        plain, _ = run(tiny, reqs, together=True, disable_cuda_graph=True, **CUDA)
        monkeypatch.setattr(NgramDrafter, "propose", _scripted_ngram(plain.ids))
        monkeypatch.setattr(NgramDrafter, "on_verified", lambda self, req, drafted, accepted: None)
    spec = _spec(algo)
    eager, _ = run(tiny, reqs, spec, together=True, disable_cuda_graph=True, **CUDA)
    log = StepLog(monkeypatch)
    graphs, sched = run(tiny, reqs, spec, together=True, cuda_graph_max_bs=4, **CUDA)
    runner = sched.runner
    verify = runner.verify_graph_runner
    assert verify is not None and verify.use_cuda_graph, "verify CUDA graphs failed their start-up check (see the log)"
    assert runner.graph_runner is not None and runner.graph_runner.use_cuda_graph
    assert verify.buckets == [1, 2, 4]
    assert graphs.ids == eager.ids
    assert log.steps and max(s[4] for s in log.steps) <= ATOL, [s for s in log.steps if s[4] > ATOL]
    served = log.of("verify", runner.model)
    assert 4 in {s[3] for s in served}, served  # 3 requests: a padding request
    drafter = sched.decode.speculator.drafter
    if algo == "STANDALONE":
        draft = drafter.runner.graph_runner
        assert draft is not None and draft.use_cuda_graph
        assert log.of("decode", drafter.runner.model)
        extend = drafter.runner.draft_extend_graph_runner
        assert extend is not None and extend.use_cuda_graph
        assert log.of("draft extend", drafter.runner.model)
        assert all(f.spec_accepted_tokens == f.spec_draft_tokens > 0 for f in graphs.final.values())
    if algo == "EAGLE3":
        assert drafter.worker.graph_runner is not None and drafter.worker.graph_runner.use_cuda_graph
        assert log.of("EAGLE draft") and runner.graph_runner.capture == drafter.capture
        extend = drafter.worker.extend_graph_runner
        assert extend is not None and extend.use_cuda_graph and extend.buckets == [1, 2, 4]
        assert 4 in {s[3] for s in log.of("EAGLE draft extend")}  # 3 requests: a padding request
    if algo == "NGRAM":
        finals = graphs.final.values()
        assert 0 < sum(f.spec_accepted_tokens for f in finals) < sum(f.spec_draft_tokens for f in finals)
