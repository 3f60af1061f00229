"""The import rules of the design card, checked on the source: every ``import`` statement, module-level or not.

- ``prefill_node``, ``decode_node`` and ``router`` never import each other;
- ``kvtransfer`` imports no role and not the router; ``common`` imports none of them and not ``kvtransfer``;
- inside ``common``, the rooms import downwards only: ``engine`` knows nothing of the node front, the wire or the
  commands; ``wire`` and ``text`` know only the shared modules at ``common``'s top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("prefill_node", "decode_node", "router")

# package (or room) -> top-level names and common rooms it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "prefill_node": ("decode_node", "router", "deploy", "benchmarks"),
    "decode_node": ("prefill_node", "router", "deploy", "benchmarks"),
    "router": ("prefill_node", "decode_node", "deploy", "benchmarks"),
    "kvtransfer": (*ROLES, "deploy", "benchmarks"),
    "common": (*ROLES, "kvtransfer", "deploy", "benchmarks"),
    "common/engine": ("common.node", "common.wire", "common.app", "common.testing"),
    "common/text": ("common.node.engine", "common.node", "common.wire", "common.app", "common.testing"),
    "common/wire": ("common.node.engine", "common.node", "common.app", "common.text", "common.testing"),
    "common/node": ("common.app", "common.testing"),
}


def imported_modules(path: Path) -> set[str]:
    """Absolute module names that ``path`` imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_the_layering_allows(package: str) -> None:
    assert (ROOT / package).is_dir(), f"{package} is gone: update FORBIDDEN"
    assert violations(package, FORBIDDEN[package]) == []


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "mod.py"
    bad.write_text("def f():\n    from router.config import RouterConfig\n    import decode_node.scheduler\n")
    assert {"router.config", "router.config.RouterConfig", "decode_node.scheduler"} <= imported_modules(bad)
