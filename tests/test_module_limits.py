"""Every module of app/, workers/ and hsx/ stays small enough to read in one sitting: at most
``MAX_LINES`` lines, and at most ``MAX_PROJECT_IMPORTS`` distinct modules of the three roots imported
(module level or inside a function, as tests/test_import_layers.py reads them). A module that needs more is
doing more than one thing (issue 38: the job runner imported 34 and ran to 487 lines).
"""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.stack import REPO
from tests.test_import_layers import import_graph

MAX_LINES = 400
MAX_PROJECT_IMPORTS = 20


def _path(module: str) -> Path:
    base = REPO.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _lines(module: str) -> int:
    return len(_path(module).read_text().splitlines())


def test_the_limits_measure_what_they_say() -> None:
    graph = import_graph()
    assert {"workers.job_runner", "workers.unit_pipeline", "app.main", "hsx.cli.main"} <= set(graph)
    # Deferred imports count: the CLI's commands import what they run inside the functions that run them.
    assert {"workers.worker_main", "hsx.server.db.migrate"} <= graph["hsx.cli.service_commands"]
    assert "workers.job_plan" in graph["workers.job_runner"]
    assert _lines("workers.job_runner") == len((REPO / "workers" / "job_runner.py").read_text().splitlines())


def test_no_module_is_over_the_line_limit() -> None:
    over = {module: _lines(module) for module in import_graph() if _lines(module) > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines: {over}"


def test_no_module_imports_more_than_the_limit_of_the_projects_modules() -> None:
    graph = import_graph()
    over = {module: len(targets) for module, targets in graph.items() if len(targets) > MAX_PROJECT_IMPORTS}
    assert not over, f"importing more than {MAX_PROJECT_IMPORTS} of the project's modules: {over}"
