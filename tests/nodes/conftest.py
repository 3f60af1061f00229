"""Fixtures of the node tests that run a prefill and a decode ``Scheduler`` in this process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from common.text.tokenizer import load_tokenizer
from tests.model_fixtures import make_tiny_model

CLUSTER_TOKEN = "test-cluster-token"


@pytest.fixture
def pd_bootstrap(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any, int]]:
    """(the tiny llama's path, its tokenizer, the port of a bootstrap server the pair meets through), with the
    cluster token set; the server stops after the test."""
    from kvtransfer.bootstrap import BootstrapServer

    monkeypatch.setenv("PDCLUSTER_CLUSTER_TOKEN", CLUSTER_TOKEN)
    model = str(make_tiny_model("llama"))
    bootstrap = BootstrapServer(CLUSTER_TOKEN)
    port = bootstrap.start()
    try:
        yield model, load_tokenizer(model), port
    finally:
        bootstrap.stop()
