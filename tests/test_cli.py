"""The operator's commands, run as a user would: ``hsx verify``, ``hsx db upgrade`` and ``hsx bench``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.fixtures.stack import REPO


def hsx(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hsx.cli", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_verify_passes_on_a_safe_engine_and_matches_the_reference(engine_nocache: Any) -> None:
    done = hsx("verify", "--engine-url", engine_nocache.url, "--reference")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True
    names = {c["name"] for c in report["checks"]}
    assert {"prompt_a.cached_tokens", "prompt_b.cached_tokens", "prompt_b.dumped_tokens"} <= names
    # --reference adds one transformers comparison per verification prompt, each above its threshold.
    prompts = {n.split(".", 1)[0] for n in names if n.startswith("prompt_")}
    cosines = {c["name"]: c for c in report["checks"] if c["name"].endswith(".reference_cosine")}
    assert prompts and set(cosines) == {f"{p}.reference_cosine" for p in prompts}, sorted(names)
    for check in cosines.values():
        threshold = float(check["expected"].removeprefix(">= "))
        assert check["ok"] and check["actual"] and min(check["actual"].values()) >= threshold, check


def test_verify_fails_naming_cached_tokens_on_a_prefix_caching_engine(engine_cache: Any) -> None:
    done = hsx("verify", "--engine-url", engine_cache.url)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    failed = [c for c in report["checks"] if not c["ok"]]
    assert report["ok"] is False and any("cached_tokens" in c["name"] for c in failed), failed


def test_verify_against_nothing_fails_cleanly() -> None:
    done = hsx("verify", "--engine-url", "http://127.0.0.1:9")
    assert done.returncode == 1
    assert json.loads(done.stdout)["ok"] is False


def test_db_upgrade_creates_the_job_table(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'jobs.sqlite3'}"
    done = hsx("db", "upgrade", env={"HSX_DATABASE_URL": url})
    assert done.returncode == 0, done.stderr
    import sqlalchemy

    names = set(sqlalchemy.inspect(sqlalchemy.create_engine(url)).get_table_names())
    assert {"jobs", "work_units", "shards", "rejections", "alembic_version"} <= names


def test_bench_runs_the_checkouts_benchmark() -> None:
    """``hsx bench NAME`` runs bench/NAME.py of the checkout hsx is installed from (its --help here)."""
    done = hsx("bench", "pipeline", "--help")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("usage: hsx bench pipeline"), done.stdout
