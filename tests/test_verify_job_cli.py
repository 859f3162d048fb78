"""``hsx verify --job`` through the installed console script, against the API over HTTP (README: "may this
engine serve that job"; "checks a few samples of an fp8 job against it"): the job's own engine passes,
with the fp8 checks of the stored samples among its checks, and exits 0. (Another checkpoint's engine
failing it, exit 1, is tests/test_engine_identity.py's.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import Stack
from tests.fixtures.synthetic import write_pretokenized

pytestmark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
HSX = Path(sys.executable).parent / "hsx"


def test_verify_job_through_the_cli_passes_an_fp8_job_on_its_own_engine(
    synthetic_stack: Stack, tmp_path: Path
) -> None:
    from hsx.server.settings import get_settings
    from workers.job_runner import JobRunner

    stack = synthetic_stack
    data = write_pretokenized(tmp_path / "d.jsonl", [40] * 6)
    job_id = stack.submit(data, samples_per_shard=3, state_dtype="fp8_e4m3")["id"]
    runner = JobRunner(job_id, get_settings())
    while runner.run(max_units=1).more_work:
        pass
    assert stack.job(job_id)["state"] == "succeeded"
    with serve_in_thread(stack.client.app) as api_url:
        done = subprocess.run(
            [str(HSX), "verify", "--job", job_id, "--api-url", api_url],
            env={**os.environ, **stack.env},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, (done.stdout, done.stderr)
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is True and checks["job_fitness"]["ok"] is True, report
    fp8_checks = [c for name, c in checks.items() if name.startswith("fp8.")]
    assert fp8_checks and all(c["ok"] for c in fp8_checks), fp8_checks
