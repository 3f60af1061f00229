"""Speculation's steps through compiled step runners on CPU (``--enable-torch-compile``; the CUDA graphs of the same
runners: tests/gpu/test_spec_graphs_cuda.py): the verify forwards (``VerifyGraphRunner``), EAGLE's draft steps
(``DraftGraphRunner``), the STANDALONE draft model's and the target's decode steps (``DecodeGraphRunner``), the
decode-time draft extends of EAGLE's head (``EagleExtendGraphRunner``) and of the STANDALONE draft
(``DraftExtendGraphRunner``).

For NGRAM (verify only), STANDALONE and EAGLE (a topk 2 tree): greedy output equal to eager speculation's, every
step a runner served within 1e-4 of the eager forward of the same batch (logits and features), each runner used,
with padding (1 to 3 requests run in bucket 4; extends with fewer rows than the bucket's per request); pools back
(``run``). And the start-up check: a runner whose replay is wrong is dropped with a warning, the step then runs
eagerly."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

from common.config import ServerArgs
from common.engine import graph_base
from common.engine.graph_base import StepGraphRunner
from common.engine.graph_runner import DecodeGraphRunner, split_out
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.mem.req_to_token_pool import ReqToTokenPool
from common.engine.spec.draft_extend_graph_runner import (
    EagleExtendGraphRunner,
    build_draft_extend_graph_runner,
    build_eagle_extend_graph_runner,
)
from common.engine.spec.eagle_graph_runner import DraftGraphRunner, build_draft_graph_runner
from common.engine.spec.eagle_loader import load_eagle_head
from common.engine.spec.eagle_worker import EagleWorker
from common.engine.spec.ngram import NgramDrafter
from common.engine.verify_graph_runner import VerifyGraphRunner, build_verify_graph_runner
from tests.engine.test_eagle_head import head_dir
from tests.engine.test_spec_decode import gen, greedy, prompt, run
from tests.model_fixtures import load_tiny_model, make_tiny_model

ATOL = 1e-4
COMPILE = {"enable_torch_compile": True, "torch_compile_max_bs": 4, "max_running_requests": 4}
# Every algorithm verifies STEPS + 1 rows per request, and EAGLE (not EAGLE3) captures no streams: the three tests'
# target steps have the same shapes, so inductor compiles them once per file (its graph cache); EAGLE3's captured
# streams are checked by the start-up check and on CUDA (tests/gpu/test_spec_graphs_cuda.py).
STEPS = 5


@pytest.fixture
def one_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every runner compiles bucket 4 only (inductor's CPU compile is the cost of these tests): every batch of 1 to
    3 requests is padded to it. Several buckets: tests/engine/test_graph_runner.py."""
    monkeypatch.setattr(graph_base, "batch_size_buckets", lambda max_bs: [max_bs])


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(make_tiny_model("llama"))


def _reqs() -> list:
    """Three requests (bucket 4: padded) that finish at different steps (2, then 1 left)."""
    return [gen(f"r{i}", prompt(20 + 23 * i, 40 + i), greedy(8 + 4 * i)) for i in range(3)]


def _scripted_ngram(plain: dict[str, list[int]]) -> Any:
    """NGRAM's ``propose`` drafting the plain output's next tokens, every third request-step's last draft wrong:
    long accepted runs on a model whose own output never repeats, and rejections."""
    calls = [0]

    def propose(self: NgramDrafter, reqs: list, caps: list[int]) -> list[list[int]]:
        out = []
        for r, cap in zip(reqs, caps, strict=True):
            d = plain[r.rid][len(r.output_ids):][:cap]
            calls[0] += 1
            if d and calls[0] % 3 == 0:
                d[-1] = (d[-1] + 1) % 1000
            out.append(d)
        return out

    return propose


class StepLog:
    """Wraps each runner kind's serving call: the runner's output, then the eager step of the same batch (which
    rewrites the same K/V slots) once the runner serves; records (runner kind, id of its model, rows, bucket, max |dlogits|)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple[str, int, int, int, float]] = []
        for cls in (DecodeGraphRunner, VerifyGraphRunner):
            monkeypatch.setattr(cls, "forward_features", self._wrap_target(cls.forward_features))
        monkeypatch.setattr(DraftGraphRunner, "forward", self._wrap_head(DraftGraphRunner.forward, False))
        monkeypatch.setattr(EagleExtendGraphRunner, "forward", self._wrap_head(EagleExtendGraphRunner.forward, True))

    def _record(self, runner: StepGraphRunner, model: Any, rows: int, n: int, got: torch.Tensor,
                want: torch.Tensor, got_f: torch.Tensor, want_f: torch.Tensor) -> None:
        err = float((model.compute_logits(got) - model.compute_logits(want)).abs().max())
        err = max(err, float((got_f - want_f).abs().max()))
        self.steps.append((runner.kind, id(model), rows, runner._bucket(n), err))

    def _wrap_target(self, serve: Any) -> Any:
        def checked(runner: Any, fb: Any, *bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
            if not runner.serving:  # its start-up check
                return serve(runner, fb, *bucket)
            hidden, features = (t.clone() for t in serve(runner, fb))
            runner.eager_backend.init_forward_metadata(fb)
            want, want_f = split_out(runner._step(runner.model, fb))
            self._record(runner, runner.model, fb.num_tokens, fb.batch_size, hidden, want, features, want_f)
            return hidden, features

        return checked

    def _wrap_head(self, serve: Any, extend: bool) -> Any:
        """EAGLE's head steps: a draft step (one row per branch) or, with ``extend``, a draft extend."""
        def checked(runner: Any, fb: Any, hidden: torch.Tensor, *bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
            if not runner.serving:
                return serve(runner, fb, hidden, *bucket)
            logit_h, feature = (t.clone() for t in serve(runner, fb, hidden))
            fb.attn_metadata = None
            head = runner.model if extend else runner.head
            want, want_f = head(fb, hidden)
            rows, reqs = (fb.num_tokens, fb.batch_size) if extend else (fb.batch_size, -(-fb.batch_size // runner.topk))
            self._record(runner, head, rows, reqs, logit_h, want, feature, want_f)
            return logit_h, feature

        return checked

    def of(self, kind: str, model: Any = None) -> list[tuple[str, int, int, int, float]]:
        return [s for s in self.steps if s[0] == kind and (model is None or s[1] == id(model))]


def _compare(tiny: str, spec: dict[str, Any], log: StepLog) -> Any:
    reqs = _reqs()
    eager, _ = run(tiny, reqs, spec, together=True, max_running_requests=4)
    torch._dynamo.reset()
    start = time.monotonic()
    compiled, sched = run(tiny, reqs, spec, together=True, **COMPILE)
    print(f"compiled run {time.monotonic() - start:.1f} s")
    runner = sched.runner
    assert runner.verify_graph_runner is not None, "the verify runner failed its start-up check (see the log)"
    assert runner.verify_graph_runner.buckets == [4]
    assert compiled.ids == eager.ids
    assert sum(f.spec_draft_tokens for f in compiled.final.values()) > 0
    assert log.steps and max(s[4] for s in log.steps) <= ATOL, [s for s in log.steps if s[4] > ATOL]
    verify = log.of("verify", runner.model)
    assert verify and {s[3] for s in verify} == {4}, verify  # 1 to 3 requests: padded
    return compiled, sched


def test_ngram_verify_steps_compiled_match_eager(tiny, monkeypatch, one_bucket) -> None:
    plain, _ = run(tiny, _reqs(), together=True, max_running_requests=4)
    monkeypatch.setattr(NgramDrafter, "propose", _scripted_ngram(plain.ids))
    monkeypatch.setattr(NgramDrafter, "on_verified", lambda self, req, drafted, accepted: None)
    log = StepLog(monkeypatch)
    out, _ = _compare(tiny, {"speculative_algorithm": "NGRAM", "speculative_num_steps": STEPS}, log)
    finals = out.final.values()
    assert 0 < sum(f.spec_accepted_tokens for f in finals) < sum(f.spec_draft_tokens for f in finals)


def test_standalone_draft_and_verify_steps_compiled_match_eager(tiny, monkeypatch, one_bucket) -> None:
    log = StepLog(monkeypatch)
    # The target as its own draft: every draft accepted, so a wrong draft step changes the accepted tokens.
    spec = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": tiny,
            "speculative_num_steps": STEPS}
    out, sched = _compare(tiny, spec, log)
    assert all(f.spec_accepted_tokens == f.spec_draft_tokens for f in out.final.values())
    draft = sched.decode.speculator.drafter.runner
    assert draft.graph_runner is not None and draft.graph_runner.buckets == [4]
    assert log.of("decode", draft.model)  # the draft model's decode steps
    extend = draft.draft_extend_graph_runner
    assert extend is not None and extend.buckets == [4] and extend.num_rows == 2
    served = log.of("draft extend", draft.model)  # after each full accept: the last draft and the target's token
    assert served and any(s[2] < 4 * 2 for s in served), served  # padding requests / rows


def test_eagle_tree_draft_and_verify_steps_compiled_match_eager(tiny, monkeypatch, one_bucket) -> None:
    log = StepLog(monkeypatch)
    spec = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head_dir("EAGLE")),
            "speculative_num_steps": 3, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": STEPS + 1}
    _, sched = _compare(tiny, spec, log)
    worker = sched.decode.speculator.drafter.worker
    assert worker.graph_runner is not None
    draft = log.of("EAGLE draft")
    assert draft and all(s[2] % 2 == 0 for s in draft), draft  # topk rows per request
    assert worker.extend_graph_runner is not None and worker.extend_graph_runner.num_rows == 4
    extend = log.of("EAGLE draft extend")  # after each verify: the verified token and the accepted path
    assert extend and any(s[2] < 4 * 4 for s in extend), extend
    assert sched.runner.graph_runner is not None  # plain decode steps keep their runner under EAGLE


def test_wrong_replays_fall_back_to_eager(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A verify / draft runner whose compiled step computes the wrong thing fails its start-up check: a warning with
    the reason, ``None`` (eager), and the check's dummy KV and table rows are restored."""
    model = load_tiny_model("llama")
    cfg = model.config
    args = ServerArgs(enable_torch_compile=True, torch_compile_max_bs=2, max_running_requests=4)
    pool = MHATokenToKVPool(64, 4, torch.float32, model.num_local_kv_heads, cfg.head_dim, cfg.num_layers)
    r2t = ReqToTokenPool(5, cfg.context_len)

    def wrong(self: StepGraphRunner, bs: int, _: int) -> Any:
        rows = bs * getattr(self, "num_rows", getattr(self, "topk", 1))
        zeros = torch.zeros(rows, cfg.hidden_size)
        return zeros, zeros

    monkeypatch.setattr(VerifyGraphRunner, "_run_compiled", wrong)
    monkeypatch.setattr(DraftGraphRunner, "_run_compiled", wrong)  # the extend runners' too: VerifyGraphRunner's
    head = load_eagle_head(head_dir("EAGLE"), "EAGLE", model, torch.float32, torch.device("cpu"))
    worker = EagleWorker(head, pool.num_pages, 4, 4, 2, 3, 6)
    with caplog.at_level(logging.WARNING):
        assert build_verify_graph_runner(args, model, pool, r2t, model.make_attn_backend(), 6) is None
        assert build_draft_graph_runner(args, head, worker.kv_pool, worker.attn_backend, 2, 4, 3,
                                        cfg.context_len + 11) is None
        assert build_eagle_extend_graph_runner(args, head, worker.kv_pool, r2t, worker.attn_backend, 3) is None
        assert build_draft_extend_graph_runner(args, model, pool, r2t, model.make_attn_backend()) is None
    text = caplog.text
    assert "verify batch size 2: logits differ from eager" in text and "verify steps run eagerly" in text
    assert "EAGLE draft batch size 2: logits differ from eager" in text and "EAGLE draft steps run eagerly" in text
    assert "EAGLE draft extend batch size 2: logits differ" in text and "EAGLE draft extend steps run eagerly" in text
    msgs = [r.getMessage() for r in caplog.records]  # the STANDALONE draft's (its kind is a suffix of EAGLE's)
    assert any("RuntimeError: draft extend batch size 2: logits differ" in m for m in msgs), msgs
    assert "draft extend steps run eagerly" in msgs
    assert all(not buf.any() for buf in pool.k_buffer + pool.v_buffer + worker.kv_pool.k_buffer)
    assert not r2t.req_to_token.any()
