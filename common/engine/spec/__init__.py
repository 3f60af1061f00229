"""Speculative decoding (``--speculative-algorithm``; the flags: ``common.speculative``).

A decode step of the running batch becomes draft -> verify -> accept, inside the scheduler's one loop::

    update_running_batch   Speculator.prepare: Drafter.propose -> ScheduleBatch.prepare_for_verify (TARGET_VERIFY,
                           spec_info = VerifyInput), or a plain decode step when nothing was drafted
    run_batch              one target forward over [last, drafts] per request, a sampled token at every position
    process_batch_result   each request's accepted run through append_token, token by token; rejected pages freed

Modules: ``drafter`` (the interface), one module per algorithm (``ngram``, ``standalone``, ``eagle``), ``verify``
(the accept rule and the sampling rows of the draft positions), ``info`` (``VerifyInput``), ``speculator`` (the
step), ``tree`` (tree drafts in the verify step). EAGLE's parts: ``eagle_model`` / ``eagle_loader`` (the head),
``eagle_worker`` (its forwards), ``eagle_tree`` (top-k steps to a tree), ``path_kv`` (the accepted path's KV).
Colocated and decode nodes speculate without the overlap schedule (a step's drafts need the previous step's accepted
tokens); a prefill node, which verifies nothing, keeps it: its draft work (STANDALONE's extend over each chunk,
EAGLE's head extend and handoff state) is the target forward's ``spec_hook``, run on the forward thread in launch
order (``common.engine.overlap.overlap_schedule_on``). CUDA graphs / compiled steps serve the verify forwards
(``common.engine.verify_graph_runner``), the plain decode steps (with EAGLE capturing what the head reads), the
draft model's decode steps (its own ``ModelRunner``), EAGLE's draft steps (``eagle_graph_runner``) and the
decode-time DRAFT_EXTEND of EAGLE's head and of the draft model (``draft_extend_graph_runner``); prefill-time extends
run eagerly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from common.speculative import draft_len, max_draft_tokens

if TYPE_CHECKING:
    from common.config import ServerArgs
    from common.engine.model_runner import ModelRunner
    from common.engine.spec.speculator import Speculator

# --speculative-algorithm -> the module whose ``build_drafter(args, runner, draft_len, dp_rank)`` makes its drafter.
DRAFTERS = {
    "NGRAM": "common.engine.spec.ngram",
    "STANDALONE": "common.engine.spec.standalone",
    "EAGLE": "common.engine.spec.eagle",
    "EAGLE3": "common.engine.spec.eagle",
}


def build_speculator(args: ServerArgs, runner: ModelRunner, dp_rank: int = 0) -> Speculator | None:
    """The rank's speculator for ``--speculative-algorithm`` (None: off); the drafter's module is imported lazily."""
    from common.engine.spec.speculator import Speculator

    algo = args.speculative_algorithm
    if algo is None:
        return None
    if algo not in DRAFTERS:
        raise ValueError(f"--speculative-algorithm {algo} has no drafter (the flags' check refuses it)")
    k = draft_len(args)
    drafter = importlib.import_module(DRAFTERS[algo]).build_drafter(args, runner, k, dp_rank)
    runner.build_spec_graph_runners(max_draft_tokens(args) + 1)
    return Speculator(drafter, k, runner.model_config.vocab_size, max_draft_tokens(args))
