"""``pip install hsx`` alone is the trainer SDK (issue 38, item 1): a virtual environment with the package
and exactly its base dependencies (pyproject's ``project.dependencies``), plus the pinned CPU torch that
tensors need, runs a trainer against a running job, streamed through the API with ``JobStream`` and then
offline from the job's output with ``hsx.loader``, ``hsx.torch_data`` and a SpecForge export. The server's
packages are absent there, and importing them fails, so nothing of the SDK can lean on them.

The venv is built once per test session under pytest's temporary directory, from a wheel of this checkout
built in a copy of it (the checkout is left untouched), with pip reading the local package index.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import REPO, TEST_TOKEN, Stack, make_stack
from tests.fixtures.synthetic import Engines, expected_tensors, write_pretokenized

# What the API, the workers and the CLI import; the SDK must run with none of them installed.
SERVER_PACKAGES = (
    "fastapi",
    "uvicorn",
    "sqlalchemy",
    "alembic",
    "psycopg",
    "rq",
    "redis",
    "pydantic",
    "rich",
)
PACKAGE_SOURCES = ("hsx", "app", "workers", "migrations", "pyproject.toml", "README.md")

TRAINER = r"""
import importlib, json, sys

api, job_id, token, output_dir, export_dir = sys.argv[1:6]
absent = {}
for name in json.loads(sys.argv[6]):
    try:
        importlib.import_module(name)
    except ImportError as exc:
        absent[name] = type(exc).__name__
    else:
        absent[name] = None

import torch
from torch.utils.data import DataLoader

from hsx.torch_data import JobStream, OutputDataset, collate_samples

streamed = {}
stream = JobStream(api, job_id, token=token, poll_seconds=0.1)
for batch in DataLoader(stream, batch_size=2, collate_fn=collate_samples):
    for row, index in enumerate(batch["index"].tolist()):
        length = int(batch["lengths"][row])
        streamed[index] = {
            "input_ids": batch["input_ids"][row, :length].tolist(),
            "hidden_state": batch["hidden_state"][row, :length].float().tolist(),
        }
    stream.ack(batch)

# Offline, once the job has succeeded: the same samples from its output directory.
offline = OutputDataset(output_dir, verify_checksums=True)
offline_items = {int(item["index"]): item for item in (offline[k] for k in range(len(offline)))}
same = all(
    offline_items[i]["input_ids"].tolist() == s["input_ids"]
    and torch.equal(offline_items[i]["hidden_state"].float(), torch.tensor(s["hidden_state"]))
    for i, s in streamed.items()
)

from hsx.integrations.exports import ExportOptions, export_output

report = export_output(output_dir, "specforge", export_dir, ExportOptions())

print(json.dumps({
    "absent": absent,
    "streamed": sorted(streamed),
    "offline": sorted(offline_items),
    "same": same,
    "first": streamed.get(0),
    "exported": report["counts"]["samples"],
    "server_modules": sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[6]))),
    "hsx_file": importlib.import_module("hsx").__file__,
}))
"""

# The loader and the stream reader without torch: numpy and the standard library read the shards.
NO_TORCH = r"""
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
from hsx.loader import iter_samples
from hsx.streams.reader import manifest_for
samples = list(iter_samples(sys.argv[1]))
print(len(samples), samples[0].hidden_state.dtype)
"""


def _run(argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # Nothing of the checkout on the path: the venv's installed package is what runs.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _checked(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with hsx and only its base dependencies (and the pinned CPU torch); its python."""
    root = tmp_path_factory.getbasetemp() / "base-install"
    python = root / "venv" / "bin" / "python"
    if python.exists():
        return python
    source = root / "source"
    source.mkdir(parents=True)
    for name in PACKAGE_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    wheels = root / "wheels"
    _checked(_run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                   "-w", str(wheels), str(source)], cwd=root))  # fmt: skip
    _checked(_run([sys.executable, "-m", "venv", str(root / "venv")], cwd=root))
    base = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (wheel,) = wheels.glob("hsx-*.whl")
    constraints = str(REPO / "constraints" / "cpu.txt")
    # No byte-compiling: torch alone has thousands of modules, and each test imports only a few of them.
    install = [str(python), "-m", "pip", "install", "-q", "--no-compile"]
    _checked(_run([*install, "--no-deps", str(wheel)], cwd=root))
    _checked(_run([*install, "-c", constraints, *base, "torch"], cwd=root))
    return python


@pytest.fixture
def running(
    db_url: str, redis_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    from hsx.server.settings import get_settings

    stack = make_stack(db_url, redis_url, engines.start().url, tmp_path, monkeypatch)
    try:
        yield stack
    finally:
        stack.stop_workers()
        get_settings.cache_clear()


def test_the_base_install_holds_only_the_sdk_dependencies(base_venv: Path) -> None:
    installed = _checked(_run([str(base_venv), "-m", "pip", "list", "--format=json"], cwd=base_venv.parent))
    names = {p["name"].lower().replace("_", "-") for p in json.loads(installed)}
    assert {"hsx", "numpy", "httpx", "torch"} <= names
    assert not names & {"fastapi", "sqlalchemy", "rq", "alembic", "redis", "pydantic", "uvicorn"}, names


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_trainer_on_the_base_install_streams_a_running_job_then_reads_it_offline(
    base_venv: Path, running: Stack
) -> None:
    from app.main import create_app

    stack = running
    data = write_pretokenized(stack.tmp / "d.jsonl", [24] * 6)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    job_id = stack.submit(data, samples_per_shard=2)["id"]
    stack.start_worker()
    script = stack.tmp / "trainer.py"
    script.write_text(TRAINER)
    with serve_in_thread(create_app()) as api:
        output_dir = Path(stack.job(job_id)["output_dir"])
        argv = [str(base_venv), str(script), api, job_id, TEST_TOKEN, str(output_dir), str(stack.tmp / "sf")]
        out = _checked(_run([*argv, json.dumps(SERVER_PACKAGES)], cwd=stack.tmp))
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    assert stack.job(job_id)["state"] == "succeeded"
    # The server's packages are not there: each import failed, and none was loaded by the SDK.
    assert result["absent"] == dict.fromkeys(SERVER_PACKAGES, "ModuleNotFoundError"), result["absent"]
    assert result["server_modules"] == []
    assert Path(result["hsx_file"]).is_relative_to(base_venv.parent.parent)  # the installed copy ran
    assert result["streamed"] == result["offline"] == list(range(6))
    assert result["same"] is True
    want = expected_tensors(records[0]["input_ids"], "engine")["hidden_state"]
    assert result["first"]["input_ids"] == records[0]["input_ids"]
    assert result["first"]["hidden_state"] == want.float().tolist()
    assert result["exported"] == 6 and (stack.tmp / "sf").is_dir()

    no_torch = _checked(_run([str(base_venv), "-c", NO_TORCH, str(output_dir)], cwd=stack.tmp))
    assert no_torch.split() == ["6", "float32"]
