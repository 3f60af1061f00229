"""The decode step and prefill at real shapes, each against its floor (the GPU check's ``scale`` step).

Per ``--model-size`` (a generated llama, config and tokenizer only, ``--load-format dummy`` weights), one process
builds our ``ModelRunner`` once and measures, on its own KV pool and page tables (no scheduler, no prefill needed
to reach a context: the pages are laid out directly, KV contents do not change the timings):

    decode   one decode step per (batch, context) of ``--batches`` x ``--contexts``: CUDA-graph replay of the
             forward (buckets = the batches) + the LM head + argmax, median of ``--steps`` steps (CUDA events);
             its floor = (bytes of every weight the step reads (all but the embedding table) + the KV bytes of
             batch x context tokens) / the card's measured copy bandwidth (a device copy: bytes read + written / s);
             target: <= 1.3x the floor (1.5x from 8k context), the issue's for 8B
    prefill  one request of each ``--prefill`` length, eager as served (extend attention, logits of the last
             token): tokens/s and MFU = model FLOPs (2 x params x tokens + causal attention) / s / the card's bf16
             dense peak (by device name: ``PEAK_BF16_TFLOPS``); targets 50 % at 4k, 40 % at 16k
    verify   per (batch, context) with batch in ``--verify-batches``: one speculative verify step of ``--verify-rows``
             rows per request (a chain: the last token and its drafts, TARGET_VERIFY) at that context, as served
             (``VerifyGraphRunner``: CUDA-graph replay) + the LM head + argmax over every row; recorded beside the
             plain decode step of that point (``verify_over_decode``); no target (issue 51 asks for it recorded)
A point that misses its target gets a torch profiler table (top ops by device time over a few steps), at most
``--profile-misses`` per size. Points whose KV does not fit the device are reported as skipped, with the sizes.

    python3 -m benchmarks.model_scale --model-size 8b --model-size 1b --json $OUT/scale.json    # on a GPU
    python -m benchmarks.model_scale --device cpu --dtype float32 --model-size tiny --batches 1,4 \\
        --contexts 32,96 --prefill 64 --steps 2 --json /tmp/scale.json                           # the dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# bf16 dense tensor-core peak, TFLOP/s, from the vendors' data sheets; the first key in the device name wins.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H800": 989.0,
                    "A100": 312.0, "L40S": 362.0}
DECODE_TARGET = {1024: 1.3, 8192: 1.5}  # ratio to the floor by context (the nearest at or below; 1.3 below 1k)
PREFILL_TARGET = {4096: 0.5, 16384: 0.4}  # MFU by prompt length
KV_RESERVE_BYTES = 8 << 30  # left free for activations, graphs and logits when sizing the pool on a GPU
PROFILE_STEPS = 4


def peak_tflops(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def decode_target(context: int) -> float:
    return max([1.3, *(v for k, v in DECODE_TARGET.items() if context >= k)])


def copy_bandwidth_gbs(device: torch.device) -> float:
    """A device copy of 1 GiB (256 KiB on CPU): (bytes read + written) / seconds, median of 5."""
    n = (1 << 30) if device.type == "cuda" else (1 << 18)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = [_timed(device, lambda: dst.copy_(src)) for _ in range(6)][1:]
    return 2 * n / statistics.median(times) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` keeps the device busy (CUDA events; wall clock on CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def profile_table(device: torch.device, fn: Callable[[], object], steps: int) -> str:
    """Top ops of ``steps`` calls of ``fn`` by self device time (CPU time on CPU): where a missed target's time goes."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=10, max_name_column_width=60)


class Bench:
    """One model on one device: a ``ModelRunner`` (dummy weights) whose pool holds ``kv_tokens`` tokens."""

    def __init__(self, a: argparse.Namespace, size: str, kv_tokens: int) -> None:
        from common.config import ServerArgs
        from common.engine.model_runner import ModelRunner

        self.device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
        self.page = a.page_size
        bs_max = max(a.batches)
        self.args = ServerArgs(device=a.device, dtype=a.dtype, load_format="dummy", page_size=self.page,
                               max_total_tokens=kv_tokens, max_running_requests=bs_max, disable_cuda_graph=True,
                               cuda_graph_max_bs=bs_max, torch_num_threads=a.threads)
        self.runner = ModelRunner(self.args, a.model_path)
        self.model = self.runner.model
        self.graphs = None
        if self.device.type == "cuda" and not a.disable_cuda_graph:
            from common.engine.graph_runner import DecodeGraphRunner

            graphs = DecodeGraphRunner(self.args.replace(disable_cuda_graph=False), self.model, self.runner.kv_pool,
                                       self.runner.req_to_token_pool, self.runner.attn_backend, True, 0)
            graphs.buckets = sorted(set(a.batches))  # only the measured batch sizes are captured
            with torch.inference_mode(), torch.cuda.device(self.device):
                graphs.warm_up()  # raises if a graph's logits are off eager's
            self.graphs = graphs
        self.verify_graphs = None
        if self.graphs is not None and a.verify_batches:
            from common.engine.verify_graph_runner import VerifyGraphRunner

            verify = VerifyGraphRunner(self.args.replace(disable_cuda_graph=False), self.model, self.runner.kv_pool,
                                       self.runner.req_to_token_pool, self.runner.attn_backend, True, 0,
                                       a.verify_rows)
            verify.buckets = sorted(set(a.verify_batches))
            with torch.inference_mode(), torch.cuda.device(self.device):
                verify.warm_up()
            verify.serving = True
            self.verify_graphs = verify

    def verify_batch(self, bs: int, context: int, rows: int) -> Any:
        """A verify step of ``bs`` requests at ``context`` tokens, the last ``rows`` of them new (a chain)."""
        from common.engine.forward_batch import ForwardMode

        fb = self.batch(bs, context, extend=False)
        slots = self.runner.req_to_token_pool.device_req_to_token[:bs, context - rows : context]
        pos = torch.arange(context - rows, context, device=self.device)
        i64 = {"dtype": torch.int64, "device": self.device}
        fb.forward_mode, fb.out_cache_loc, fb.positions = ForwardMode.TARGET_VERIFY, slots.reshape(-1), pos.repeat(bs)
        fb.input_ids = torch.randint(3, self.model.config.vocab_size, (bs * rows,), **i64)
        fb.extend_lens, fb.prefix_lens = torch.full((bs,), rows, **i64), torch.full((bs,), context - rows, **i64)
        fb.extend_lens_cpu, fb.prefix_lens_cpu = [rows] * bs, [context - rows] * bs
        fb.attn_metadata = None
        self.runner.attn_backend.init_forward_metadata(fb)
        return fb

    def verify_fn(self, fb: Any) -> Callable[[], object]:
        model, graphs = self.model, self.verify_graphs

        def step() -> object:
            hidden = graphs.forward_features(fb)[0] if graphs is not None else model.forward(fb)
            return model.compute_logits(hidden).argmax(-1)
        return step

    def batch(self, bs: int, context: int, extend: bool) -> Any:
        """A decode step of ``bs`` requests at ``context`` tokens (the last one new), or one extend of ``context``
        new tokens (``bs`` 1); pages shuffled over the pool (page 0 is padding)."""
        from common.engine.forward_batch import ForwardBatch, ForwardMode

        dev, ps = self.device, self.page
        per_req = -(-context // ps)
        pages = torch.randperm(bs * per_req, generator=torch.Generator().manual_seed(bs)) + 1
        pos = torch.arange(context)
        slots = pages.view(bs, per_req)[:, pos // ps] * ps + pos % ps  # [bs, context]
        table = self.runner.req_to_token_pool.device_req_to_token
        table[:bs, :context] = slots.to(dev)
        new = slots if extend else slots[:, -1:]
        n = new.shape[1]
        i64 = {"dtype": torch.int64, "device": dev}
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND if extend else ForwardMode.DECODE, batch_size=bs,
            input_ids=torch.randint(3, self.model.config.vocab_size, (bs * n,), **i64),
            positions=(pos if extend else torch.full((bs,), context - 1)).to(dev),
            out_cache_loc=new.reshape(-1).to(dev), req_pool_indices=torch.arange(bs, **i64),
            seq_lens=torch.full((bs,), context, **i64), extend_lens=torch.full((bs,), n, **i64),
            prefix_lens=torch.full((bs,), context - n, **i64), req_to_token=table,
            seq_lens_cpu=[context] * bs, extend_lens_cpu=[n] * bs, prefix_lens_cpu=[context - n] * bs,
            kv_pool=self.runner.kv_pool, attn_backend=self.runner.attn_backend)
        self.runner.attn_backend.init_forward_metadata(fb)
        return fb

    def step_fn(self, fb: Any, last_only: bool) -> Callable[[], object]:
        model, graphs = self.model, self.graphs

        def step() -> object:
            hidden = graphs.forward(fb) if graphs is not None and not last_only else model.forward(fb)
            return model.compute_logits(hidden[-1:] if last_only else hidden).argmax(-1)
        return step

    def close(self) -> None:
        self.graphs = self.verify_graphs = self.runner = self.model = None  # type: ignore[assignment]
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def model_facts(path: str, dtype: torch.dtype) -> dict[str, Any]:
    """Parameter counts (meta device, nothing allocated) and KV bytes per token of the model folder."""
    from common.engine.mem.kv_pool import MHATokenToKVPool
    from common.engine.model.config import ModelConfig
    from common.engine.model.llama import LlamaForCausalLM

    cfg = ModelConfig.from_path(path, "dummy")
    with torch.device("meta"):
        params = {n: p.numel() for n, p in LlamaForCausalLM(cfg, dtype=dtype, device="meta").named_parameters()}
    size = torch.empty(0, dtype=dtype).element_size()
    embed = params["model.embed_tokens.weight"]
    head = params.get("lm_head.weight", embed)
    total = sum(params.values())
    return {"hidden": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab": cfg.vocab_size, "params": total,
            "weight_bytes": total * size, "read_bytes": (total - embed if "lm_head.weight" in params else total) * size,
            "body_params": total - embed - (head if "lm_head.weight" in params else 0), "head_params": head,
            "kv_bytes_per_token": MHATokenToKVPool.bytes_per_token(cfg.num_kv_heads, cfg.head_dim, cfg.num_layers,
                                                                  dtype)}


def prefill_flops(m: dict[str, Any], tokens: int) -> float:
    """2 x (decoder weights) x tokens + causal attention (QK^T and PV over half the square) + the last token's
    LM head."""
    attn = 2 * tokens * tokens * m["heads"] * m["head_dim"] * m["layers"]
    return 2.0 * m["body_params"] * tokens + attn + 2.0 * m["head_params"]


def run_size(a: argparse.Namespace, size: str, work: Path) -> dict[str, Any]:
    from common.engine.model_runner import DTYPES
    from common.model_gen.make_model import make_model

    dtype = DTYPES[a.dtype]
    a.model_path = str(make_model("llama", size, work / size, weights=False))
    m = model_facts(a.model_path, dtype)
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    gpu, peak = peak_tflops(device)
    out: dict[str, Any] = {"model_size": size, "model": m, "gpu": gpu, "peak_bf16_tflops": peak,
                           "dtype": a.dtype, "decode": [], "prefill": [], "skipped": []}
    need = {(bs, ctx): bs * (-(-ctx // a.page_size) * a.page_size) for bs in a.batches for ctx in a.contexts}
    need_prefill = max([-(-n // a.page_size) * a.page_size for n in a.prefill] or [0])
    fits = (torch.cuda.mem_get_info(device)[0] - m["weight_bytes"] - KV_RESERVE_BYTES) // m["kv_bytes_per_token"] \
        if device.type == "cuda" else max([*need.values(), need_prefill])
    for point, tokens in need.items():
        if tokens > fits:
            out["skipped"].append({"batch": point[0], "context": point[1], "reason": (
                f"KV of {tokens} tokens ({tokens * m['kv_bytes_per_token'] / 2**30:.1f} GiB) does not fit beside "
                f"the weights ({fits * m['kv_bytes_per_token'] / 2**30:.1f} GiB free for KV)")})
    kv_tokens = max([t for t in [*need.values(), need_prefill] if t <= fits] or [a.page_size])
    t0 = time.monotonic()
    bench = Bench(a, size, kv_tokens + a.page_size)
    out["startup_s"] = round(time.monotonic() - t0, 1)
    out["cuda_graphs"] = bench.graphs is not None
    out["verify_cuda_graphs"] = bench.verify_graphs is not None
    out["verify"] = []
    out["copy_bandwidth_gbs"] = bw = copy_bandwidth_gbs(device)
    profiles = 0
    try:
        with torch.inference_mode():
            for (bs, ctx), tokens in need.items():
                if tokens > fits:
                    continue
                step = bench.step_fn(bench.batch(bs, ctx, extend=False), last_only=False)
                for _ in range(3):
                    step()
                ms = 1e3 * statistics.median(_timed(device, step) for _ in range(a.steps))
                floor = 1e3 * (m["read_bytes"] + bs * ctx * m["kv_bytes_per_token"]) / (bw * 1e9)
                point = {"batch": bs, "context": ctx, "step_ms": ms, "floor_ms": floor, "ratio": ms / floor,
                         "target": decode_target(ctx), "weight_floor_ms": 1e3 * m["read_bytes"] / (bw * 1e9)}
                point["met"] = point["ratio"] <= point["target"]
                if not point["met"] and profiles < a.profile_misses:
                    point["profile"] = profile_table(device, step, PROFILE_STEPS)
                    profiles += 1
                out["decode"].append(point)
                print(f"{size} decode bs {bs:4d} ctx {ctx:6d}: {ms:8.3f} ms, floor {floor:7.3f} ms "
                      f"({point['ratio']:.2f}x, target {point['target']}x)", flush=True)
                if bs in a.verify_batches and ctx > a.verify_rows:
                    verify = bench.verify_fn(bench.verify_batch(bs, ctx, a.verify_rows))
                    for _ in range(3):
                        verify()
                    vms = 1e3 * statistics.median(_timed(device, verify) for _ in range(a.steps))
                    out["verify"].append({"batch": bs, "context": ctx, "rows": a.verify_rows, "verify_ms": vms,
                                          "decode_ms": ms, "verify_over_decode": vms / ms})
                    print(f"{size} verify bs {bs:4d} ctx {ctx:6d} x {a.verify_rows} rows: {vms:8.3f} ms "
                          f"({vms / ms:.2f}x the decode step)", flush=True)
            for n in a.prefill:
                step = bench.step_fn(bench.batch(1, n, extend=True), last_only=True)
                step()
                secs = statistics.median(_timed(device, step) for _ in range(max(1, a.steps // 4)))
                flops = prefill_flops(m, n)
                row = {"tokens": n, "seconds": secs, "tok_per_s": n / secs, "tflops": flops / secs / 1e12,
                       "mfu": None if peak is None else flops / secs / (peak * 1e12),
                       "target_mfu": PREFILL_TARGET.get(n)}
                row["met"] = None if row["mfu"] is None or row["target_mfu"] is None else row["mfu"] >= row["target_mfu"]
                if row["met"] is False and profiles < a.profile_misses:
                    row["profile"] = profile_table(device, step, 1)
                    profiles += 1
                out["prefill"].append(row)
                print(f"{size} prefill {n:6d} tokens: {row['tok_per_s']:10.0f} tok/s, {row['tflops']:.1f} TFLOP/s"
                      + (f", MFU {row['mfu']:.0%}" if row["mfu"] is not None else ""), flush=True)
    finally:
        bench.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-size", action="append", default=[], help="generated llama size, repeatable (1b, 8b)")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--prefill", default="4096,16384", help="prompt lengths of the prefill runs ('' for none)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per point (prefill: a quarter)")
    p.add_argument("--profile-misses", type=int, default=4, help="profiler tables per size for missed targets")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--verify-batches", default="1,8", help="batches whose verify step is timed ('' for none)")
    p.add_argument("--verify-rows", type=int, default=4, help="rows per request of a timed verify step")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",") if x]
    a.contexts = [int(x) for x in a.contexts.split(",") if x]
    a.prefill = [int(x) for x in a.prefill.split(",") if x]
    a.verify_batches = [int(x) for x in a.verify_batches.split(",") if x]
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible (use --device cpu for the dry run)")
    torch.set_num_threads(a.threads)
    result: dict[str, Any] = {"sizes": {}}
    with tempfile.TemporaryDirectory(prefix="pdc-scale-") as tmp:
        for size in a.model_size or ["8b", "1b"]:
            try:
                result["sizes"][size] = run_size(a, size, Path(tmp))
            except Exception as e:  # recorded: the next size still runs
                result["sizes"][size] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                print(f"{size}: {result['sizes'][size]['error']}", flush=True)
            Path(a.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    if any("error" in r for r in result["sizes"].values()):
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
