"""The processes that need no model forward import neither torch nor transformers (seconds of CPU per start):
a node's front (its gRPC servicers, the SGLang HTTP front, reading the model's config and tokenizer), the router,
and the ``pdcluster`` command and ``up`` supervisor. Checked in a fresh interpreter, so a re-added import fails."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.model_fixtures import make_tiny_model

HEAVY = ("torch", "transformers")
PROCESS_MODULES = {
    "node front": ["common.node.serve", "common.node.front", "common.node.sglang_http", "prefill_node.servicer",
                   "decode_node.servicer"],
    "router": ["router.server", "router.service", "router.tokenize_worker"],
    "pdcluster command and up supervisor": ["common.app.cli", "common.app.up", "common.app.up_args", "common.app.supervisor"],
}


def heavy_modules_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("process", PROCESS_MODULES)
def test_entry_modules_import_no_torch(process: str) -> None:
    assert heavy_modules_after("\n".join(f"import {m}" for m in PROCESS_MODULES[process])) == []


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_front_reads_its_model_without_torch(arch: str) -> None:
    path = str(make_tiny_model(arch))
    code = (
        "from common.engine.model.config import ModelConfig\n"
        "from common.text.tokenizer import load_tokenizer\n"
        f"cfg = ModelConfig.from_path({path!r})\n"
        f"tok = load_tokenizer({path!r})\n"
        "tok.decode(tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True))\n"
        "cfg.fingerprint()\n"
    )
    assert heavy_modules_after(code) == []
