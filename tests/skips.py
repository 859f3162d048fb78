"""The skips CI accepts. Any other skip fails a run with ``HSX_FAIL_ON_SKIP=1`` (``.ci/run`` sets it): a
skip inside a test, and a skip while collecting (``pytest.importorskip`` or ``pytest.skip(...,
allow_module_level=True)`` at a module's top, which skips every test of the module before any exists). This
module is the pytest plugin that enforces it (tests/conftest.py loads it); tests/test_skip_gate.py runs it
over test files of its own.

A skip hides a test that proves nothing on this machine: the disk-full tests without tmpfs mounts, the
dashboard test without chromium, the trainer readers without their packages. CI's machine has all of those,
so only what cannot run there at all may be listed, each with the reason it cannot. Keys are test node ids
without their parameters.
"""

from __future__ import annotations

import os

import pytest

ALLOWED_SKIPS: dict[str, str] = {
    "tests/test_sglang_guards.py::test_real_sglang_final_server_arguments_at_tp_2": (
        "needs a site with sglang 0.5.17 and triton (about 1.2 GB, HSX_SGLANG_SITE); the stand-in tests "
        "beside it run always"
    ),
    "tests/test_sglang_layout_guards.py::test_real_sglang_layouts": (
        "needs a site with sglang 0.5.17 and triton (about 1.2 GB, HSX_SGLANG_SITE); the stand-in tests "
        "beside it run always"
    ),
}

FAIL_ON_SKIP_ENV = "HSX_FAIL_ON_SKIP"


def unlisted(skipped: dict[str, str]) -> dict[str, str]:
    """The skipped node ids (with their reasons) that are not on the allowlist."""
    return {node: reason for node, reason in skipped.items() if node.split("[", 1)[0] not in ALLOWED_SKIPS}


# Skips seen in this run, by node id (a module's own id for a skip at collection). Under xdist the workers'
# test reports reach pytest_runtest_logreport in the controller, and their skipped collection reports
# pytest_collectreport there.
_skipped: dict[str, str] = {}


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped[report.nodeid] = _reason(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _skipped[report.nodeid] = _reason(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller decides
    if os.environ.get(FAIL_ON_SKIP_ENV) == "1" and unlisted(_skipped) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if hasattr(terminalreporter.config, "workerinput"):
        return
    extra = unlisted(_skipped)
    if not extra:
        return
    strict = os.environ.get(FAIL_ON_SKIP_ENV) == "1"
    title = "skips not on the allowlist (tests/skips.py)" + (": failing the run" if strict else "")
    terminalreporter.section(title, sep="=", red=strict, yellow=not strict)
    for node, reason in sorted(extra.items()):
        terminalreporter.line(f"{node}: {reason}")
