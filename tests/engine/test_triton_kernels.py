"""Triton kernels (paged decode/extend attention, KV page gather/scatter) and the triton attention backend against
their torch references, on CPU through Triton's interpreter.

Why a subprocess: ``TRITON_INTERPRET=1`` must be set before Triton compiles (decorates) a kernel, and it is
process-wide: set in this pytest process it would leak into every later test that touches Triton (the GPU tests
in ``tests/gpu`` would then run interpreted). So one child process with the variable set runs every case of
``tests.triton_interpreted_cases`` once (one torch/Triton import for all of them) and writes a JSON report; each
test here asserts its own case's entry. The parent never imports Triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.triton_interpreted_cases import CASES

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 420  # the interpreted cases take ~40 s quiet; minutes on a loaded 2-core machine


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("triton") / "report.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "proto"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "tests.triton_interpreted_cases", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"interpreted Triton run failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.timeout(CHILD_TIMEOUT_S + 60)  # the first case's setup runs the whole interpreted child
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(report: dict[str, Any], case: str) -> None:
    result = report[case]
    assert result["ok"], result.get("error")


def test_triton_backend_refused_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.config import ServerArgs
    from common.errors import ConfigError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="attention-backend torch"):
        ServerArgs(device="cpu", attention_backend="triton")
    with pytest.raises(ConfigError, match="--attention-backend must be one of"):
        ServerArgs(attention_backend="flash")
    assert ServerArgs(device="cpu").resolved_attention_backend == "torch"
    assert ServerArgs(device="cuda").resolved_attention_backend == "triton"
    assert ServerArgs(device="cuda", attention_backend="torch").resolved_attention_backend == "torch"


def test_cpu_engine_does_not_load_triton_kernels() -> None:
    """The default CPU product path never loads the Triton kernels or backend (no JIT work at start-up). The
    ``triton`` package itself may still be imported by torch._dynamo, which transformers pulls in."""
    code = (
        "import sys\n"
        "KERNELS = {'common.engine.model.triton_backend', 'common.engine.kernels.decode_attention',\n"
        "           'common.engine.kernels.extend_attention', 'common.engine.kernels.kv_pages_triton'}\n"
        "from common.node.engine import Engine\n"
        "from tests.model_fixtures import make_tiny_model\n"
        "e = Engine(model_path=str(make_tiny_model('llama')), max_total_tokens=256, max_running_requests=4)\n"
        "e.generate(input_ids=[[5, 6, 7]], sampling_params={'max_new_tokens': 2})\n"
        "e.shutdown()\n"
        "print(sorted(m for m in sys.modules if m in KERNELS))\n"
    )
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "proto"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
