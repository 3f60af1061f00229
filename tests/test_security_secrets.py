"""The cluster secret has no public default: nodes refuse to start without one, launchers generate one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import env
from common.app.up import cluster_env
from common.errors import ConfigError
from common.wire.security import require_cluster_token
from kvtransfer.args import KVTransferConfig

ROOT = Path(__file__).resolve().parents[1]


def test_no_default_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCLUSTER_CLUSTER_TOKEN", raising=False)
    monkeypatch.delenv("PDCLUSTER_CLUSTER_TOKEN_FILE", raising=False)
    assert env.cluster_token() == ""
    with pytest.raises(ValueError, match="PDCLUSTER_CLUSTER_TOKEN"):
        KVTransferConfig()
    with pytest.raises(ConfigError, match="PDCLUSTER_CLUSTER_TOKEN"):
        require_cluster_token("decode")
    assert require_cluster_token("null") == ""


def test_token_from_a_mounted_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCLUSTER_CLUSTER_TOKEN", raising=False)
    (tmp_path / "token").write_text("a-secret-from-a-mounted-file\n")
    monkeypatch.setenv("PDCLUSTER_CLUSTER_TOKEN_FILE", str(tmp_path / "token"))
    assert require_cluster_token("prefill") == "a-secret-from-a-mounted-file"


def test_up_generates_a_fresh_secret_per_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCLUSTER_CLUSTER_TOKEN", raising=False)
    first, second = cluster_env()["PDCLUSTER_CLUSTER_TOKEN"], cluster_env()["PDCLUSTER_CLUSTER_TOKEN"]
    assert len(first) == 64 and first != second


def test_disaggregated_node_refuses_to_start_without_the_secret() -> None:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("PDCLUSTER_CLUSTER_TOKEN")}
    child_env["PYTHONPATH"] = f"{ROOT}:{ROOT / 'proto'}"
    proc = subprocess.run([sys.executable, "-m", "common.app.cli", "serve", "--disaggregation-mode", "decode",
                           "--port", "0"], env=child_env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "PDCLUSTER_CLUSTER_TOKEN" in proc.stderr
