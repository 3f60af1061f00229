"""Where a decode step's host time goes: thread CPU time per scheduler/forward function at batch ``--batch``.

A decode step of a large batch on a GPU is bound by the host once the forward is one CUDA-graph replay: the
scheduler thread (batch bookkeeping, result processing, outputs) and the forward thread (input packing, launch,
sampling) share one GIL. This runs our colocated ``Engine`` on ``--batch`` prompts of ``--input-len`` tokens to
``--output-len`` greedy tokens and reports, per decode step: the wall time, and each wrapped function's thread CPU
time (``time.thread_time``: what the function itself burns, not the GIL or the GPU it waits for) and call count.

``--null-forward`` replaces the model's forward and logits by constants (a CPU stand-in for the graph replay: what
is left is the host's own work), so the host-side cost can be measured and cut on a machine without a GPU.

    python -m benchmarks.host_step --null-forward                       # CPU, tiny llama, batch 64
    python3 -m benchmarks.host_step --device cuda --dtype bfloat16 --model-size 1b --json $OUT/host_step.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# (module, class, method): the functions of one decode step, on the scheduler thread then the forward thread
WRAPPED = [
    ("common.engine.scheduler", "Scheduler", "step"),
    ("common.engine.scheduler", "Scheduler", "get_next_batch_to_run"),
    ("common.engine.schedule_batch", "ScheduleBatch", "prepare_for_decode"),
    ("common.engine.model_worker", "ModelWorker", "launch"),
    ("common.engine.sampling.sampler", "SamplingBatchInfo", "from_reqs"),
    ("common.engine.model_worker", "ModelWorker", "result"),
    ("common.engine.scheduler", "Scheduler", "process_batch_result"),
    ("common.engine.scheduler_output", "OutputCollector", "flush"),
    ("common.engine.model_runner", "ModelRunner", "launch"),
    ("common.engine.model_runner", "ModelRunner", "_forward_batch"),
    ("common.engine.graph_runner", "DecodeGraphRunner", "forward_features"),
    ("common.engine.sampling.sampler", "Sampler", "__call__"),
]


class Accounts:
    def __init__(self) -> None:
        self.cpu: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._undo: list[Callable[[], None]] = []

    def wrap(self, module: str, cls_name: str, name: str) -> None:
        import importlib

        cls = getattr(importlib.import_module(module), cls_name)
        raw = cls.__dict__[name]
        f = raw.__func__ if isinstance(raw, classmethod) else raw
        label = f"{cls_name}.{name}"

        @functools.wraps(f)
        def timed(*a: Any, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                self.cpu[label] += time.thread_time() - t
                self.calls[label] += 1

        setattr(cls, name, classmethod(timed) if isinstance(raw, classmethod) else timed)
        self._undo.append(lambda: setattr(cls, name, raw))

    def clear(self) -> None:
        self.cpu.clear()
        self.calls.clear()

    def undo(self) -> None:
        for u in reversed(self._undo):
            u()


def null_forward() -> None:
    """Forward and logits as constants of the right shapes (the model's weights are never read)."""
    from common.engine.model import llama

    logits: dict[tuple[int, torch.device], torch.Tensor] = {}

    def forward(self: Any, fb: Any) -> torch.Tensor:
        return torch.zeros(fb.input_ids.shape[0], self.config.hidden_size, device=fb.input_ids.device)

    def compute_logits(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        key = (hidden.shape[0], hidden.device)
        if key not in logits:
            logits[key] = torch.randn(hidden.shape[0], self.config.vocab_size, device=hidden.device)
        return logits[key]

    llama.LlamaForCausalLM.forward = forward  # type: ignore[method-assign]
    llama.LlamaForCausalLM.compute_logits = compute_logits  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="HF folder (default: generate a llama of --model-size)")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--null-forward", action="store_true", help="constant forward and logits (host work only)")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    torch.set_num_threads(a.threads)
    if a.null_forward:
        null_forward()
    tmp = None
    model_path = a.model_path
    if model_path is None:
        from common.model_gen.make_model import make_model

        tmp = tempfile.TemporaryDirectory(prefix="pdc-host-")
        model_path = str(make_model("llama", a.model_size, Path(tmp.name), seed=0))
    from common.node.engine import Engine

    overlap = {"disable_overlap_schedule": True} if a.disable_overlap_schedule else {"enable_overlap_schedule": True}
    engine = Engine(model_path=model_path, device=a.device, dtype=a.dtype, page_size=16,
                    max_running_requests=max(a.batch, 8), **overlap)
    acc = Accounts()
    for w in WRAPPED:
        acc.wrap(*w)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}
    walls = []
    try:
        for rep in range(a.repeats + 1):  # the first warms up (and fills every cache)
            prompts = [[rng.randrange(5, vocab) for _ in range(a.input_len)] for _ in range(a.batch)]
            acc.clear()
            t = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=params)
            if rep:
                walls.append((time.perf_counter() - t) / a.output_len)
    finally:
        acc.undo()
        engine.shutdown()
        if tmp is not None:
            tmp.cleanup()
    steps = acc.calls["Scheduler.step"] or 1
    result = {
        "bench": "host_step", "device": a.device, "model_size": a.model_size, "dtype": a.dtype, "batch": a.batch,
        "input_len": a.input_len, "output_len": a.output_len, "null_forward": a.null_forward,
        "overlap": not a.disable_overlap_schedule,
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None},
        "wall_ms_per_output_token_median": statistics.median(walls) * 1e3,
        "last_repeat": {"scheduler_steps": steps, "functions": {
            k: {"cpu_ms_per_step": v * 1e3 / steps, "calls_per_step": acc.calls[k] / steps}
            for k, v in acc.cpu.most_common()}},
    }
    print(f"wall {result['wall_ms_per_output_token_median']:.3f} ms per output token (median of {a.repeats}); "
          f"last repeat, per scheduler step ({steps} steps):")
    for k, v in result["last_repeat"]["functions"].items():
        print(f"  {v['cpu_ms_per_step']:8.3f} ms CPU  {v['calls_per_step']:5.2f} calls  {k}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
