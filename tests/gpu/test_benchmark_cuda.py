"""``benchmarks/engine_throughput.py --device cuda`` on the ``1b`` preset in bf16 (a small workload)."""

from __future__ import annotations

import functools
from pathlib import Path

from common.model_gen import make_model
from tests.model_fixtures import _session_dir


@functools.cache
def model_1b() -> Path:
    return make_model("llama", "1b", _session_dir() / "llama-1b-s0", seed=0)


def test_engine_throughput_runs_on_cuda_bf16(tmp_path: Path) -> None:
    from benchmarks.engine_throughput import main

    out = tmp_path / "result.json"
    result = main(["--device", "cuda", "--dtype", "bfloat16", "--model-path", str(model_1b()),
                   "--num-prompts", "8", "--input-len", "32", "--output-len", "16", "--repeats", "1",
                   "--json", str(out)])
    assert out.is_file()
    assert result["ours"]["output_tok_per_s"] > 0 and result["hf"]["output_tok_per_s"] > 0
    assert result["ours"]["decode_step_ms"] > 0
    assert result["weight_bytes"] > 1.9e9  # ~1.0 B bf16 parameters
