"""The direction of imports, read from the source (every import statement of every module under app/,
workers/ and hsx/, at module level or inside a function, since a deferred import is still a dependency).

Every module belongs to exactly one layer, named by where it lives (a module in none fails the test):

=============  =====================================  ========================================
layer          modules                                may import (besides itself)
=============  =====================================  ========================================
sdk            hsx's top-level modules, hsx.streams   nothing else
integrations   hsx.integrations.*                     sdk
server         hsx.server.*                           sdk
engine         hsx.engine.*                           sdk, server
workers        workers.*                              sdk, integrations, server, engine
app            app.*                                  all but cli
cli            hsx.cli.* (the composition root)       all
=============  =====================================  ========================================

Further rules:

- the SDK never imports the server: it and the integrations are the base install (``pip install hsx``), so
  their third-party imports are only the base dependencies and the optional ones of the functions that
  build tensors or reach a trainer or an object store (:data:`THIRD_PARTY`);
- inside the server: hsx.server.streams -> hsx.server.jobs -> hsx.server.db, each importing only those below
  it, and hsx.server.storage, which the jobs use to upload, imports none of the three;
- the contract and layout modules (what engines, workers, the API and readers agree on) import only each
  other;
- no circle between modules, and none between hsx's packages.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from tests.fixtures.stack import REPO

ROOTS = ("app", "workers", "hsx")
# What each layer may import besides itself.
MAY_IMPORT = {
    "sdk": frozenset(),
    "integrations": frozenset({"sdk"}),
    "server": frozenset({"sdk"}),
    "engine": frozenset({"sdk", "server"}),
    "workers": frozenset({"sdk", "integrations", "server", "engine"}),
    "app": frozenset({"sdk", "integrations", "server", "engine", "workers"}),
    "cli": frozenset({"sdk", "integrations", "server", "engine", "workers", "app"}),
}
SUBPACKAGE_LAYERS = {
    "hsx.integrations": "integrations",
    "hsx.server": "server",
    "hsx.engine": "engine",
    "hsx.cli": "cli",
}
SDK_PACKAGES = ("hsx.streams",)  # the trainer's stream client; the rest of the SDK is hsx's top level
# The third-party packages the base install's modules may import: numpy and httpx (the base dependencies),
# torch where tensors are built, boto3 to read a published job's items (hsx.s3); the integrations also
# import their trainers' formats and stores, where they write or feed them.
THIRD_PARTY = {
    "sdk": frozenset({"numpy", "httpx", "torch", "boto3", "botocore"}),
    "integrations": frozenset({"numpy", "httpx", "torch", "pyarrow", "yaml", "mooncake"}),
}
SERVER_ORDER = ("hsx.server.streams", "hsx.server.jobs", "hsx.server.db")  # top first
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


def layer_of(module: str) -> str | None:
    """The layer a module is in, by where it lives; None for a module in none."""
    root = module.split(".")[0]
    if root in ("app", "workers"):
        return root
    for package, layer in SUBPACKAGE_LAYERS.items():
        if module == package or module.startswith(f"{package}."):
            return layer
    # hsx's own top-level modules (hsx.loader), and the SDK's packages; the modules of any other package
    # of hsx are in no layer until it is named above.
    if module.split(".")[0] == "hsx" and module.count(".") <= 1:
        return "sdk"
    if any(module.startswith(f"{package}.") for package in SDK_PACKAGES):
        return "sdk"
    return None


def _third_party(module: str, path: Path) -> Iterator[str]:
    """The top-level names of the packages outside the project and the standard library a module imports."""
    for name in _imported(module, path):
        top = name.split(".")[0]
        if top and top not in (*ROOTS, "__future__", "migrations") and top not in sys.stdlib_module_names:
            yield top


def _server_rank(module: str) -> int | None:
    for rank, package in enumerate(SERVER_ORDER):
        if module == package or module.startswith(f"{package}."):
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


def unassigned(graph: dict[str, set[str]]) -> list[str]:
    return sorted(module for module in graph if layer_of(module) is None)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        layer = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if layer and theirs and theirs != layer and theirs not in MAY_IMPORT[layer]:
                bad.append(f"{module} -> {target} (the {layer} layer imports the {theirs} layer)")
            rank, their_rank = _server_rank(module), _server_rank(target)
            if rank is not None and their_rank is not None and their_rank < rank:
                bad.append(f"{module} -> {target} ({SERVER_ORDER[rank]} imports {SERVER_ORDER[their_rank]})")
            if module.startswith("hsx.server.storage") and their_rank is not None:
                bad.append(f"{module} -> {target} (hsx.server.storage imports {SERVER_ORDER[their_rank]})")
            if module in CONTRACT_MODULES and target not in CONTRACT_MODULES:
                bad.append(f"{module} -> {target} (a contract module imports beyond the contract modules)")
    return bad


def third_party_violations() -> list[str]:
    bad = []
    for module, path in sorted(_sources().items()):
        allowed = THIRD_PARTY.get(layer_of(module) or "")
        if allowed is not None:
            bad.extend(
                f"{module} imports {package} (not a dependency of the base install)"
                for package in sorted(set(_third_party(module, path)) - allowed)
            )
    return bad


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    graph = import_graph()
    assert len(graph) > 120  # every module of the three roots
    # Imported only inside the function that runs the command, and as ``from package import module``.
    assert "hsx.integrations.specforge.feeder" in graph["hsx.cli.job_commands"]
    assert "hsx.integrations.specforge.feed_layout" in graph["hsx.integrations.specforge.feeder"]
    assert "hsx.server.db.stream_models" in graph["hsx.server.streams.repository"]


def test_every_module_is_in_a_layer() -> None:
    graph = import_graph()
    assert not unassigned(graph), unassigned(graph)
    layers = {layer_of(module) for module in graph}
    assert layers == set(MAY_IMPORT)  # each layer has modules: a rename that empties one fails here


def test_the_rules_catch_what_they_forbid() -> None:
    """The SDK importing the server, deferred or not, and an unlayered package, are each caught."""
    graph = {"hsx.streams.reader": {"hsx.server.settings"}, "hsx.loader": set(), "hsx.server.settings": set()}
    assert layer_violations(graph) == [
        "hsx.streams.reader -> hsx.server.settings (the sdk layer imports the server layer)"
    ]
    assert layer_violations({"hsx.server.jobs.queue": {"hsx.engine.client"}})
    assert layer_violations({"hsx.integrations.exports": {"hsx.server.settings"}})
    assert unassigned({"hsx.toolbox.thing": set(), "hsx.loader": set()}) == ["hsx.toolbox.thing"]


def test_the_base_install_imports_only_its_dependencies() -> None:
    bad = third_party_violations()
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_layer_it_may_not() -> None:
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
