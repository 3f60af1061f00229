"""tests/gpu: run only where torch sees a CUDA device (``make test-gpu``); skipped as a whole elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REASON = ("tests/gpu needs a CUDA device (torch.cuda.is_available() is False here); "
          "run `make test-gpu` on a GPU machine")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
