"""The direction of imports, read from the source (every import statement of every module under app/,
workers/ and hsx/, at module level or inside a function, since a deferred import is still a dependency):

- the layers: app -> workers -> hsx.streams -> hsx.jobs -> hsx.db, each importing only the layers below it;
- hsx.storage, which the jobs use to upload, imports none of those layers;
- the contract and layout modules (what engines, workers, the API and readers agree on) import only each
  other;
- no circle between modules, and none between hsx's packages.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

from tests.fixtures.stack import REPO

ROOTS = ("app", "workers", "hsx")
LAYERS = ("app", "workers", "hsx.streams", "hsx.jobs", "hsx.db")  # top first
# hsx.fsutil (fsync of a directory, standard library only) is how the layout writes atomically.
CONTRACT_MODULES = frozenset(
    {"hsx.contract", "hsx.layout", "hsx.manifest", "hsx.safetensors_io", "hsx.streams.contract", "hsx.fsutil"}
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(path): path for root in ROOTS for path in sorted((REPO / root).rglob("*.py"))}


def _resolve(name: str, modules: Iterable[str]) -> str | None:
    """The module of ours that ``name`` (a module, or a name inside one) lands in: its longest prefix."""
    known = set(modules)
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def _imported(module: str, path: Path) -> Iterator[str]:
    """Every dotted name the module imports, relative imports made absolute."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod.
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    sources = _sources()
    graph: dict[str, set[str]] = {module: set() for module in sources}
    for module, path in sources.items():
        for name in _imported(module, path):
            target = _resolve(name, sources)
            if target is not None and target != module and not module.startswith(f"{target}."):
                graph[module].add(target)  # a package's own __init__ is not an edge of its modules
    return graph


def _layer(module: str) -> int | None:
    for rank, layer in enumerate(LAYERS):
        if module == layer or module.startswith(f"{layer}."):
            return rank
    return None


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _package(module: str) -> str:
    """app and workers as wholes; hsx's subpackages, and each of hsx's top-level modules on its own."""
    parts = module.split(".")
    return parts[0] if parts[0] != "hsx" else ".".join(parts[:2])


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        rank = _layer(module)
        for target in sorted(targets):
            theirs = _layer(target)
            if rank is not None and theirs is not None and theirs < rank:
                bad.append(f"{module} -> {target} ({LAYERS[rank]} imports {LAYERS[theirs]}, a layer above)")
            if module.startswith("hsx.storage") and theirs is not None:
                bad.append(f"{module} -> {target} (hsx.storage imports the {LAYERS[theirs]} layer)")
            if module in CONTRACT_MODULES and target not in CONTRACT_MODULES:
                bad.append(f"{module} -> {target} (a contract module imports beyond the contract modules)")
    return bad


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    graph = import_graph()
    assert len(graph) > 120  # every module of the three roots
    # Imported only inside the function that runs the command, and as ``from package import module``.
    assert "hsx.streams.specforge_feeder" in graph["hsx.cli"]
    assert "hsx.streams.specforge_layout" in graph["hsx.streams.specforge_feeder"]
    assert "hsx.db.stream_models" in graph["hsx.streams.repository"]


def test_no_module_imports_a_layer_above_its_own() -> None:
    bad = layer_violations(import_graph())
    assert not bad, "\n".join(bad)


def test_no_circle_between_modules() -> None:
    circles = _circles(import_graph())
    assert not circles, "\n".join(" <-> ".join(circle) for circle in circles)


def test_no_circle_between_hsx_packages() -> None:
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        edges = packages.setdefault(_package(module), set())
        edges.update(_package(t) for t in targets if _package(t) != _package(module))
    circles = _circles(packages)
    assert not circles, "\n".join(" <-> ".join(circle) for circle in circles)
