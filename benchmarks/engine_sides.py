"""The sides of ``benchmarks.engine_throughput`` (and ``engine_vs_commit``, ``serving_path``): our ``Engine`` and HF
``generate`` behind one ``run(prompts, max_new) -> outputs`` interface, each in a worker process of its own (``Side``:
its own peak RSS and ``torch.set_num_threads``; ``root`` imports another checkout's engine) or in this process
(``LocalSide``, the dry run's), plus the profiler window over our engine's decode steps and the machine's facts."""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any


def random_prompts(seed: int, n: int, length: int, vocab: int, low: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n, length), generator=g).tolist()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class OursRunner:
    def __init__(self, model_path: str, engine_args: dict[str, Any]) -> None:
        from common.node.engine import Engine

        self.engine = Engine(model_path=model_path, **engine_args)

    def run(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
        outs = self.engine.generate(input_ids=prompts, sampling_params=params)
        return [list(o.output_ids) for o in outs]

    def comm_seconds(self) -> float:
        return self.engine.scheduler.tp.comm_seconds

    def close(self) -> None:
        self.engine.shutdown()


class HFRunner:
    def __init__(self, model_path: str, device: str, dtype: str, static: bool = False, dummy: bool = False) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = device
        if dummy:  # the weights our engine's --load-format dummy makes, built on the device from the config
            from common.model_gen.hf_dummy import hf_dummy_model

            self.model = hf_dummy_model(model_path, getattr(torch, dtype), device)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
        self.pad = self.model.generation_config.pad_token_id or 0
        # A static cache makes transformers compile the decode forward (its auto-compile, on by default on cuda).
        self.cache = {"cache_implementation": "static"} if static else {}

    def run(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                do_sample=False, eos_token_id=None, pad_token_id=self.pad, **self.cache,
            )
        return out[:, width:].tolist()

    def close(self) -> None:
        pass

    def comm_seconds(self) -> float:
        return 0.0


def make_runner(side: str, model_path: str, engine_args: dict[str, Any]) -> OursRunner | HFRunner:
    if side.startswith("ours"):
        return OursRunner(model_path, engine_args)
    return HFRunner(model_path, engine_args["device"], engine_args["dtype"], static=side == "hf_static",
               dummy=engine_args.get("load_format") == "dummy")


def side_worker(side: str, model_path: str, threads: int, engine_args: dict[str, Any], conn: Any,
            root: str | None = None) -> None:
    """Serve ("run", prompts, max_new) -> (seconds, outputs) and ("rss",) -> MiB until ("stop",). ``root``: a
    checkout whose ``common`` the engine is imported from (another commit's worktree)."""
    if root is not None:
        sys.path.insert(0, root)
    import torch

    torch.set_num_threads(threads)
    runner = make_runner(side, model_path, engine_args)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            runner.close()
            conn.send(None)
            return
        if msg[0] == "rss":
            conn.send(peak_rss_mib())
            continue
        if msg[0] == "profile":
            conn.send(profile_decode(runner, *msg[1:]))
            continue
        _, prompts, max_new = msg
        t0, comm0 = time.perf_counter(), runner.comm_seconds()
        outs = runner.run(prompts, max_new)
        conn.send((time.perf_counter() - t0, outs, runner.comm_seconds() - comm0))


LAUNCH_OPS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


def profile_decode(runner: OursRunner | HFRunner, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """One ``run(prompts, max_new)`` of our engine under the torch profiler (a window over its scheduler thread's
    steps), the prompts cached first so nearly all of it is decode steps: the top ops by self device time and by
    self CPU time, the kernel/graph launches per step, and device-busy against wall milliseconds per step (the
    gap is host time the GPU waited for; the profiler's own overhead inflates the wall figure)."""
    import torch

    if not isinstance(runner, OursRunner):
        raise TypeError("only our engine's side is profiled")
    runner.run(prompts, 1)  # the prompts into the prefix cache: the profiled run's prefill is one token a request
    t0 = time.perf_counter()
    runner.engine.profiler.start(timeout=30)
    try:
        runner.run(prompts, max_new)
    finally:
        prof = runner.engine.profiler.stop(timeout=60)
    wall = time.perf_counter() - t0
    avg = prof.key_averages()
    launches = {e.key: e.count for e in avg if e.key in LAUNCH_OPS}
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in avg) if torch.cuda.is_available() else 0.0
    return {
        "batch": len(prompts), "steps": max_new, "wall_s": wall,
        "wall_ms_per_step": wall / max_new * 1e3, "device_ms_per_step": device_us / max_new / 1e3,
        "launches": launches, "launches_per_step": sum(launches.values()) / max_new,
        "top_by_device_time": avg.table(sort_by=device_key, row_limit=15, max_name_column_width=60),
        "top_by_cpu_time": avg.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60),
    }


class LocalSide:
    """A side in this process (``--in-process``: the dry run's sides, where each process start costs more than the
    workload); peak RSS is then this process's, shared by every side."""

    def __init__(self, side: str, model_path: str, threads: int, engine_args: dict[str, Any]) -> None:
        import torch

        torch.set_num_threads(threads)
        self.runner = make_runner(side, model_path, engine_args)
        self.last_comm_s = 0.0

    def run(self, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
        secs, outs, self.last_comm_s = self.run_timed(prompts, max_new)
        return secs, outs

    def run_timed(self, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]], float]:
        t0, comm0 = time.perf_counter(), self.runner.comm_seconds()
        outs = self.runner.run(prompts, max_new)
        return time.perf_counter() - t0, outs, self.runner.comm_seconds() - comm0

    def profile(self, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
        return profile_decode(self.runner, prompts, max_new)

    def peak_rss_mib(self) -> float:
        return peak_rss_mib()

    def stop(self) -> None:
        self.runner.close()


class Side:
    def __init__(self, side: str, model_path: str, threads: int, engine_args: dict[str, Any],
                 root: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # NOTE: not a daemon: a TP engine starts its follower ranks as child processes.
        self.proc = ctx.Process(target=side_worker, args=(side, model_path, threads, engine_args, child, root))
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{side} worker failed to start")

    def run(self, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
        secs, outs, self.last_comm_s = self.run_timed(prompts, max_new)
        return secs, outs

    def run_timed(self, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]], float]:
        """(wall seconds, outputs, seconds in TP collectives)."""
        self.conn.send(("run", prompts, max_new))
        return self.conn.recv()

    def profile(self, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
        self.conn.send(("profile", prompts, max_new))
        return self.conn.recv()

    def peak_rss_mib(self) -> float:
        self.conn.send(("rss",))
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.conn.recv()
        self.proc.join(timeout=30)


def machine_facts(threads: int) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg()[0],
    }
