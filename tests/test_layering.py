"""The import rules of the design card, checked on the source: every ``import`` statement, module-level or not.

- ``prefill_node``, ``decode_node`` and ``router`` never import each other;
- ``kvtransfer`` imports no role and not the router; ``common`` imports none of them and not ``kvtransfer``;
- inside ``common``, the rooms import downwards only: ``engine`` knows nothing of the node front, the wire or the
  commands; ``wire``, ``text`` and ``serving`` know only the shared modules at ``common``'s top;
- ``common``'s top holds only basics, which import none of its rooms (its sub-packages);
- no two modules of the project import each other, directly or around a longer circle, counting every import that
  runs or is read when a module loads (module level, under ``if``/``try``, ``if TYPE_CHECKING:`` included); an
  import inside a function body is not counted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("prefill_node", "decode_node", "router")
PROJECT_PACKAGES = (*ROLES, "common", "kvtransfer", "deploy", "benchmarks", "tests")

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
    "common/serving": ("common.engine", "common.node", "common.wire", "common.text", "common.app", "common.testing",
                       "common.model_gen"),
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


def common_rooms(root: Path) -> tuple[str, ...]:
    """``common``'s rooms: its sub-packages, as module names."""
    return tuple(sorted(f"common.{p.name}" for p in (root / "common").iterdir() if (p / "__init__.py").is_file()))


def basics_importing_rooms(root: Path) -> list[str]:
    """Each import of a room by a module at ``common``'s top (a basic)."""
    rooms = common_rooms(root)
    return [f"{path.relative_to(root)} imports {name}" for path in sorted((root / "common").glob("*.py"))
            for name in sorted(imported_modules(path)) if any(name == r or name.startswith(r + ".") for r in rooms)]


def test_common_basics_import_no_room() -> None:
    assert {"common.engine", "common.node", "common.wire"} <= set(common_rooms(ROOT)), "rooms not found: checker broken"
    assert basics_importing_rooms(ROOT) == []


def test_the_checker_sees_a_basic_importing_a_room(tmp_path: Path) -> None:
    (tmp_path / "common" / "wire").mkdir(parents=True)
    (tmp_path / "common" / "wire" / "__init__.py").write_text("")
    (tmp_path / "common" / "basic.py").write_text("from common.errors import E\nfrom common.wire.tls import T\n")
    assert basics_importing_rooms(tmp_path) == ["common/basic.py imports common.wire.tls",
                                                "common/basic.py imports common.wire.tls.T"]


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "mod.py"
    bad.write_text("def f():\n    from router.config import RouterConfig\n    import decode_node.scheduler\n")
    assert {"router.config", "router.config.RouterConfig", "decode_node.scheduler"} <= imported_modules(bad)


def load_time_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of a module's body, under ``if`` (``TYPE_CHECKING`` too) and ``try`` included."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            yield from load_time_imports(node.body)
            yield from load_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from load_time_imports(block)


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: tuple[str, ...]) -> nx.DiGraph:
    """Module -> the project modules it imports at load time. ``from a import b`` points at ``a.b`` when that is a
    module, else at ``a``; relative imports are resolved."""
    paths = {module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph = nx.DiGraph()
    graph.add_nodes_from(paths)
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in load_time_imports(ast.parse(path.read_text(), filename=str(path)).body):
            if isinstance(node, ast.Import):
                targets = [[alias.name] for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
                targets = [[f"{base}.{alias.name}", base] for alias in node.names]
            for candidates in targets:
                target = next((t for t in candidates if t in paths), None)
                if target is not None and target != name:
                    graph.add_edge(name, target)
    return graph


def import_cycles(graph: nx.DiGraph) -> list[str]:
    """Each circle (a strongly connected set of modules) as its import edges, sorted."""
    found = []
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            edges = sorted(f"{a} -> {b}" for a, b in graph.subgraph(component).edges)
            found.append("; ".join(edges))
    return sorted(found)


def test_no_import_circle_among_the_project_modules() -> None:
    graph = import_graph(ROOT, PROJECT_PACKAGES)
    assert graph.number_of_edges() > graph.number_of_nodes() / 2, "the import graph lost its edges: checker broken"
    assert import_cycles(graph) == []


def test_the_checker_sees_an_import_circle_through_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\ndef f():\n    from pkg import d\n")  # lazy: not counted
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n")
    (pkg / "c.py").write_text("try:\n    from .a import A\nexcept ImportError:\n    pass\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    assert import_cycles(import_graph(tmp_path, ("pkg",))) == ["pkg.a -> pkg.b; pkg.b -> pkg.c; pkg.c -> pkg.a"]
