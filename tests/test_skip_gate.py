"""The skip gate (tests/skips.py, ``HSX_FAIL_ON_SKIP=1``) run as CI runs it, in a pytest of its own over
test files of the test's own: a skip inside a test, ``pytest.importorskip`` at a module's top and
``pytest.skip(..., allow_module_level=True)`` each fail the run and are listed with their reasons, with and
without xdist; a run with no skip passes, and without the variable the skips are listed but pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.stack import REPO

SKIPPING = {
    "test_in_a_test.py": "import pytest\n\n\ndef test_skips():\n    pytest.skip('skipped inside the test')\n",
    "test_import_or_skip.py": (
        "import pytest\n\npytest.importorskip('hsx_no_such_module')\n\n\ndef test_never_runs():\n    pass\n"
    ),
    "test_module_level.py": (
        "import pytest\n\npytest.skip('skipped at collection', allow_module_level=True)\n\n\n"
        "def test_never_runs():\n    pass\n"
    ),
}
PASSING = {"test_passes.py": "def test_passes():\n    assert 1 + 1 == 2\n"}
REASONS = ("skipped inside the test", "hsx_no_such_module", "skipped at collection")


def run_pytest(tmp: Path, files: dict[str, str], workers: int, strict: bool) -> Any:
    """pytest over ``files`` only, with the gate loaded as tests/conftest.py loads it and no other
    configuration of the project's."""
    for name, text in files.items():
        (tmp / name).write_text(text)
    (tmp / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "HSX_FAIL_ON_SKIP" and not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(REPO)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # seconds a run otherwise; xdist is named instead
    if strict:
        env["HSX_FAIL_ON_SKIP"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.skips", "-p", "xdist.plugin"]
    command += [
        "-p",
        "no:cacheprovider",
        "-c",
        str(tmp / "pytest.ini"),
        "--rootdir",
        str(tmp),
        "-n",
        str(workers),
        str(tmp),
    ]
    return subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def unlisted_section(output: str) -> str:
    marker = "skips not on the allowlist"
    return output[output.index(marker) :] if marker in output else ""


@pytest.mark.parametrize("workers", [0, 2])
def test_every_kind_of_skip_fails_the_run_and_is_named(tmp_path: Path, workers: int) -> None:
    done = run_pytest(tmp_path, {**PASSING, **SKIPPING}, workers, strict=True)
    assert done.returncode == 1, done.stdout + done.stderr
    section = unlisted_section(done.stdout)
    assert "failing the run" in section, done.stdout
    for name, reason in zip(SKIPPING, REASONS, strict=True):
        assert name in section and reason in section, (name, done.stdout)


def test_a_run_without_skips_passes_and_without_the_variable_skips_are_only_listed(tmp_path: Path) -> None:
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    clean = run_pytest(clean_dir, PASSING, 0, strict=True)
    assert clean.returncode == 0 and not unlisted_section(clean.stdout), clean.stdout
    lenient_dir = tmp_path / "lenient"
    lenient_dir.mkdir()
    lenient = run_pytest(lenient_dir, {**PASSING, **SKIPPING}, 0, strict=False)
    assert lenient.returncode == 0, lenient.stdout + lenient.stderr
    section = unlisted_section(lenient.stdout)
    assert "failing the run" not in section and all(name in section for name in SKIPPING), lenient.stdout
