"""``run_verification`` against real engines: it passes a safe one and catches a prefix-caching one."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hsx.engine.verify import run_verification
from tests.fixtures.engine import RunningEngine
from workers.reference_check import reference_checks

PER_PROMPT_CHECKS = (
    "cached_tokens",
    "prompt_tokens",
    "dumped_tokens",
    "input_ids",
    "finite",
    "layers",
    "hidden_size",
)


def test_a_cache_free_engine_passes(engine_nocache: RunningEngine) -> None:
    # A tag of its own: the session's engines are shared with fault tests that kill workers mid-preflight.
    report = run_verification(engine_nocache.url, rid_prefix_tag="verify-clean")
    assert report.ok, report.to_dict()
    names = {check.name for check in report.checks}
    assert "engine_info" in names
    for label in ("prompt_a", "prompt_b"):
        assert {f"{label}.{check}" for check in PER_PROMPT_CHECKS} <= names
    assert report.to_dict()["ok"] is True
    # The verification cleans up after itself.
    assert not [name for name in os.listdir(engine_nocache.dump_dir) if "verify-clean" in name]


def test_a_prefix_caching_engine_fails_on_cached_tokens(engine_cache: RunningEngine) -> None:
    report = run_verification(engine_cache.url, rid_prefix_tag="verify-cache")
    assert not report.ok
    failed = {check.name: check for check in report.failed}
    assert any("cached_tokens" in name for name in failed), report.to_dict()
    cached = failed["prompt_b.cached_tokens"]
    assert cached.expected == 0 and isinstance(cached.actual, int) and cached.actual > 40
    assert "prompt_b.dumped_tokens" in failed
    assert not [name for name in os.listdir(engine_cache.dump_dir) if "verify-cache" in name]


def test_an_explicit_dump_dir_and_tokenizer_are_used(engine_nocache: RunningEngine, model_dir: Path) -> None:
    report = run_verification(
        engine_nocache.url, dump_dir=engine_nocache.dump_dir, tokenizer_path=str(model_dir / "tokenizer.json")
    )
    assert report.ok, report.to_dict()


def test_a_wrong_dump_dir_fails_cleanly(engine_nocache: RunningEngine, tmp_path: Path) -> None:
    report = run_verification(engine_nocache.url, dump_dir=str(tmp_path), dump_wait_seconds=0.3)
    assert not report.ok
    assert {"prompt_a.dump", "prompt_b.dump"} <= {check.name for check in report.failed}


def test_an_unreadable_tokenizer_fails_cleanly(engine_nocache: RunningEngine, tmp_path: Path) -> None:
    report = run_verification(engine_nocache.url, tokenizer_path=str(tmp_path))
    assert not report.ok and [check.name for check in report.failed] == ["tokenizer"]


def test_a_dead_engine_fails_cleanly() -> None:
    started = time.monotonic()
    report = run_verification("http://127.0.0.1:9", timeout=2)
    assert not report.ok
    assert [check.name for check in report.checks] == ["engine_info"]
    assert "failed" in str(report.checks[0].actual)
    assert time.monotonic() - started < 10


def test_reference_checks_pass_for_the_reference_engine(engine_nocache: RunningEngine) -> None:
    checks = reference_checks(engine_nocache.url)
    assert [c.name for c in checks] == ["prompt_a.reference_cosine", "prompt_b.reference_cosine"]
    assert all(c.ok for c in checks), [c.to_dict() for c in checks]
    assert set(checks[0].actual) == {str(i) for i in engine_nocache.info.hf_indices}


def test_reference_checks_report_a_dead_engine() -> None:
    checks = reference_checks("http://127.0.0.1:9")
    assert [(c.name, c.ok) for c in checks] == [("reference.engine_info", False)]
