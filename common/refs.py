"""``module:name`` references: how the composition roots — the CLI's subcommand table (``common.app.cli``) and the
node's role table (``common.node.roles``) — name code of packages ``common`` must not import (the node roles, the
router, deploy, benchmarks). The one place such a reference is resolved."""

from __future__ import annotations

import importlib
from typing import Any


def load_ref(ref: str) -> Any:
    """The object named by ``"package.module:name"``."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)
