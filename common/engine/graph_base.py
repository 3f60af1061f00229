"""What every fixed-shape step runner shares (``DecodeGraphRunner``, ``VerifyGraphRunner`` and its draft-extend
subclasses ``DraftExtendGraphRunner`` / ``EagleExtendGraphRunner``, ``DraftGraphRunner``):
batch-size buckets, the CUDA-graph capture of a bucket, the compiled step function, the start-up loop that
captures/compiles each bucket and checks it against eager, and the choice among the modes the flags allow.

A runner subclass gives, per bucket ``bs``:

    _capture_inputs(bs) -> (fn, args)   the function a graph captures and its static arguments (padding only)
    _verify(bs)                          raises RuntimeError unless a dummy batch through the runner matches eager

Modes (``build_step_runner``), the first whose every bucket passes its check wins:

    cuda + triton attention, not --disable-cuda-graph:  CUDA graphs (of the compiled step with --enable-torch-compile,
                                                        then of the eager step)
    --enable-torch-compile (any device):                the compiled step, buckets up to --torch-compile-max-bs
    none passes:                                        ``None``: the step runs eagerly (each failure logged)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from common.config import ServerArgs

logger = logging.getLogger(__name__)

# Largest |logits - eager logits| / max(1, max |eager logits|) the start-up check accepts: a graph that reads a
# wrong row, length or slot is off by O(1) of the logits' scale; one that is right differs by summation order only.
VERIFY_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def batch_size_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256 and of 16 beyond (SGLang's capture sizes), ending at ``max_bs``."""
    sizes = [1, 2, 4, 8, *range(16, 257, 8), *range(272, max_bs + 16, 16)]
    out = [s for s in sizes if s < max_bs]
    return [*out, max_bs]


def capture_max_bs(args: ServerArgs, use_cuda_graph: bool, compile_max_bs: int, *bounds: int) -> int:
    """The largest bucket of a runner: the graphs' (``--cuda-graph-max-bs``) or the compiled step's cap, within
    ``bounds`` (the most requests a batch of that step can hold)."""
    cap = args.resolved_cuda_graph_max_bs if use_cuda_graph else compile_max_bs
    return max(1, min(cap, *bounds))


def check_close(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Raises RuntimeError when ``got`` (logits through a runner) is non-finite or further than ``VERIFY_RTOL`` of
    eager's scale from ``want``."""
    if not bool(torch.isfinite(got).all()):
        raise RuntimeError(f"{what}: non-finite logits")
    err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
    if err > VERIFY_RTOL[dtype]:
        raise RuntimeError(f"{what}: logits differ from eager by {err:.3g} of their scale (> {VERIFY_RTOL[dtype]})")


class StepGraphRunner:
    """Buckets, graphs and the compiled step of one kind of fixed-shape step (``kind`` names it in the log)."""

    kind = "step"

    def __init__(self, max_bs: int, device: torch.device, dtype: torch.dtype, use_cuda_graph: bool,
                 compile_max_bs: int, step: Callable[..., Any]) -> None:
        """``step``: the eager step function the graphs capture / ``torch.compile`` compiles; ``compile_max_bs``:
        buckets up to it run the compiled one (0: nothing compiled)."""
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = max_bs
        self.device = device
        self.dtype = dtype
        self.use_cuda_graph = use_cuda_graph
        self.compile_max_bs = compile_max_bs
        self._step = step
        self._compiled: Callable[..., Any] | None = None
        if compile_max_bs > 0:
            self._compiled = torch.compile(step)
            # One cache entry per bucket and runner: the runners of a process (decode, verify, a draft model's
            # decode) compile the same code objects, so each adds its buckets to the limit (past it dynamo would
            # run the frame eagerly, and the start-up check could not tell).
            torch._dynamo.config.recompile_limit += len(self.buckets) + 4
            torch._dynamo.config.accumulated_recompile_limit += len(self.buckets) + 4
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # or anything with replay() (tests on CPU)
        self._graph_out: dict[int, Any] = {}
        self._graph_pool: object = None
        self.serving = False  # set once every bucket passed its start-up check

    def _bucket(self, n: int) -> int:
        for bs in self.buckets:
            if bs >= n:
                return bs
        raise ValueError(f"{self.kind} batch of {n} exceeds the largest bucket {self.max_bs}")

    def _step_fn(self, bs: int) -> Callable[..., Any]:
        return self._compiled if self._compiled is not None and bs <= self.compile_max_bs else self._step

    def _call_compiled(self, *args: Any) -> Any:
        """The compiled step with batch dims static per bucket (one graph each)."""
        assert self._compiled is not None
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            return self._compiled(*args)

    # -- start-up --------------------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Capture (CUDA graphs) or compile every bucket, then check each against eager on a dummy batch. Raises
        on the first failure; the caller falls back to eager."""
        what = f"capturing CUDA graphs of {self.kind} steps" if self.use_cuda_graph else f"compiling {self.kind} steps"
        if self.compile_max_bs:
            what += f" (torch.compile up to batch {self.compile_max_bs})"
        logger.info("%s for batch sizes %s", what, self.buckets)
        start = time.monotonic()
        for i, bs in enumerate(reversed(self.buckets)):  # largest first: smaller graphs reuse its memory pool
            t0 = time.monotonic()
            if self.use_cuda_graph:
                self._capture(bs)
            self._verify(bs)
            logger.info("%s batch size %d ready (%d/%d, %.1f s)", self.kind, bs, i + 1, len(self.buckets),
                        time.monotonic() - t0)
        logger.info("%s done in %.1f s", what, time.monotonic() - start)

    def _capture_inputs(self, bs: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        raise NotImplementedError

    def _verify(self, bs: int) -> None:
        raise NotImplementedError

    def _capture(self, bs: int) -> None:
        fn, args = self._capture_inputs(bs)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton JIT, autotuning and compilation happen here, outside the capture
                fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (transfer, gRPC) may touch CUDA while this one captures.
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            out = fn(*args)
        self._graph_pool = graph.pool()
        self._graphs[bs] = graph
        self._graph_out[bs] = out

    def _replay(self, bs: int) -> Any:
        self._graphs[bs].replay()
        return self._graph_out[bs]


def step_runner_options(args: ServerArgs, device: torch.device, kind: str) -> list[tuple[bool, int]]:
    """(CUDA graphs, compile_max_bs) for each mode the flags allow, best first (module docstring)."""
    if args.disaggregation_mode == "prefill":
        return []  # prefill nodes run no decode steps
    compile_bs = args.torch_compile_max_bs if args.enable_torch_compile else 0
    graphs = args.use_cuda_graph and device.type == "cuda"
    if graphs and args.resolved_attention_backend != "triton":
        logger.warning("%s CUDA graphs off: they need --attention-backend triton (got %s)", kind,
                       args.attention_backend)
        graphs = False
    if args.device == "cuda" and args.tp_size > 1 and not args.disable_cuda_graph:
        logger.warning("%s CUDA graphs off: not supported with --tp-size %d yet", kind, args.tp_size)
    options: list[tuple[bool, int]] = []
    if graphs:
        options.append((True, compile_bs))
        if compile_bs:
            options.append((True, 0))
    elif compile_bs:
        options.append((False, compile_bs))
    return options


def build_step_runner(args: ServerArgs, device: torch.device, kind: str,
                      make: Callable[[bool, int], StepGraphRunner]) -> Any:
    """The runner ``make(use_cuda_graph, compile_max_bs)`` of the first mode whose warm-up passes, or ``None`` (the
    step runs eagerly) when none is asked for or each failed its start-up check (each failure logged as a warning
    with its reason)."""
    options = step_runner_options(args, device, kind)
    for use_graphs, compile_max_bs in options:
        runner = make(use_graphs, compile_max_bs)
        try:
            with torch.inference_mode():  # the mode serving runs in (dynamo guards on it)
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        runner.warm_up()
                else:
                    runner.warm_up()
        # NOTE: whatever breaks a capture or a compile (CUDA, Triton, dynamo, inductor errors) must leave a node
        # that serves eagerly; the reason is logged, nothing is swallowed silently.
        except Exception as exc:
            logger.warning("%s %s failed at start-up, falling back: %s: %s", kind,
                           "CUDA graphs" if use_graphs else "torch.compile", type(exc).__name__, exc)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            continue
        runner.serving = True
        return runner
    if options:
        logger.warning("%s steps run eagerly", kind)
    return None
