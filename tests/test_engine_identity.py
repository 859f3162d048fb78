"""A worker whose engine differs from the job's never takes a unit of it: another checkpoint of the same
shape, another tokenizer or chat template, a prefix cache without per-request namespaces. The job lists
the engines it met and why each was unfit; ``/readyz`` and ``hsx verify`` say why too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import REPO, make_stack
from tests.fixtures.synthetic import Engines, tokenizer_copy, write_pretokenized
from tests.test_job_recovery import runner, unit_rows
from tests.test_submit_preflight import settled_readyz

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
CHATS = REPO / "data" / "sample_chats.jsonl"


def owners(stack: Any, job_id: str) -> set[str]:
    return {u["owner"].rsplit("@", 1)[1] for u in unit_rows(stack, job_id) if u["owner"]}


def test_engines_report_a_fingerprint_and_a_context_length(engines: Engines, model_dir: Path) -> None:
    from hsx.engine.client import EngineClient
    from hsx.engine.model_identity import model_fingerprint

    one, same = engines.start(), engines.start()
    other = engines.start("--seed", "8", "--context-length", "99")
    with EngineClient(one.url) as a, EngineClient(same.url) as b, EngineClient(other.url) as c:
        first, second, third = a.info(), b.info(), c.info()
    assert first.model_fingerprint and first.model_fingerprint == second.model_fingerprint
    assert third.model_fingerprint != first.model_fingerprint, "another seed is another checkpoint"
    assert (first.context_length, third.context_length) == (32768, 99)
    # A model directory's fingerprint covers config and weights, and ignores where the copy came from.
    assert model_fingerprint(model_dir) == model_fingerprint(model_dir)
    assert model_fingerprint(model_dir).startswith("sha256:")


@postgres_only
def test_another_checkpoint_of_the_same_shape_never_takes_a_unit(
    db_url: str, redis_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.engine.verify import run_verification

    job_engine, other = engines.start(), engines.start("--seed", "8")
    stack = make_stack(db_url, redis_url, job_engine.url, tmp_path, monkeypatch)
    job_id = stack.submit(write_pretokenized(tmp_path / "d.jsonl", [30] * 6), samples_per_shard=2)["id"]
    assert runner(job_engine.url)(job_id).run(max_units=1).more_work
    refused = runner(other.url)(job_id).run()
    assert "unfit" in refused.summary and "another checkpoint" in refused.summary, refused
    doc = stack.job(job_id)
    assert doc["progress"]["units_done"] == 1 and owners(stack, job_id) == {job_engine.url}
    entries = {e["url"]: e for e in doc["engines"]}
    assert entries[job_engine.url]["state"] == "ok" and entries[job_engine.url]["verified"] is True
    assert entries[other.url]["state"] == "unfit" and "model fingerprint" in entries[other.url]["reason"]
    assert entries[other.url]["model_fingerprint"] != doc["engine"]["extra"]["model_fingerprint"]
    # hsx verify --job and /readyz say the same about the other engine.
    report = run_verification(other.url, job=doc)
    fitness = next(c for c in report.checks if c.name == "job_fitness")
    assert not report.ok and not fitness.ok and "another checkpoint" in fitness.actual
    monkeypatch.setenv("HSX_ENGINE_URL", other.url)
    from hsx.server.settings import get_settings

    get_settings.cache_clear()
    ready = settled_readyz(stack).json()
    assert ready["checks"]["engine"] == "ok"
    assert "another checkpoint" in ready["engine_unfit_for_jobs"][job_id]
    runner(job_engine.url)(job_id).run()
    done = stack.job(job_id)
    assert done["state"] == "succeeded" and owners(stack, job_id) == {job_engine.url}
    # The same through the command line, against the API over HTTP.
    with serve_in_thread(stack.client.app) as api_url:
        verify = hsx_cli(stack, "verify", "--engine-url", other.url, "--job", job_id, "--api-url", api_url)
        assert verify.returncode == 1 and "another checkpoint" in verify.stdout, verify
        retry = hsx_cli(stack, "retry", job_id, "--json", "--api-url", api_url)
        assert retry.returncode == 2 and json.loads(retry.stdout)["error"] == "nothing_to_retry", retry


def hsx_cli(stack: Any, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **stack.env, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "hsx.cli", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@postgres_only
def test_another_chat_template_never_takes_a_unit(
    db_url: str,
    redis_url: str,
    engines: Engines,
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    template = (model_dir / "chat_template.jinja").read_text()
    edited = tokenizer_copy(model_dir, tmp_path / "edited", template + "{# edited #}")
    job_engine = engines.start("--tokenizer", str(model_dir))
    other = engines.start("--tokenizer", str(edited))
    stack = make_stack(db_url, redis_url, job_engine.url, tmp_path, monkeypatch)
    job_id = stack.submit(CHATS, samples_per_shard=8)["id"]
    assert runner(job_engine.url)(job_id).run(max_units=1).more_work
    refused = runner(other.url)(job_id).run()
    assert "chat template sha256" in refused.summary, refused
    runner(job_engine.url)(job_id).run()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded" and owners(stack, job_id) == {job_engine.url}
    assert {e["url"]: e["state"] for e in doc["engines"]} == {job_engine.url: "ok", other.url: "unfit"}


@postgres_only
def test_a_prefix_cache_is_unfit_even_with_namespaces_and_readyz_says_why(
    db_url: str, redis_url: str, engine_cache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = make_stack(db_url, redis_url, engine_cache.url, tmp_path, monkeypatch, engine_fleet="true")
    data = write_pretokenized(tmp_path / "d.jsonl", [30] * 2)
    # Per-request namespaces (the default) are a second guard, never a licence: the engine is refused.
    job_id = stack.submit(data)["id"]
    assert stack.job(job_id)["options"]["cache_namespace_per_request"] is True
    refused = runner(engine_cache.url)(job_id).run()
    assert "prefix cache is on" in refused.summary, refused
    doc = stack.job(job_id)
    assert doc["state"] == "queued" and doc["progress"]["units_total"] == 0
    assert "per-request cache namespaces do not make it fit" in doc["engines"][0]["reason"]
    ready = stack.client.get("/readyz").json()
    assert any("prefix cache on" in note for note in ready["engine_notes"]), ready
    assert "prefix cache is on" in ready["engine_unfit_for_jobs"][job_id]


def test_readyz_and_verify_say_why_an_engine_is_unfit(
    engines: Engines, tmp_path: Path, stack_factory: Callable[..., Any]
) -> None:
    from hsx.engine.verify import run_verification

    liar = engines.start("--reported-dtype", "float16")
    report = run_verification(liar.url)
    failed = {c.name: c for c in report.failed}
    assert "prompt_a.dtype" in failed and failed["prompt_a.dtype"].actual == ["BF16"], report.to_dict()
    honest = run_verification(engines.start().url)
    assert honest.ok, honest.to_dict()
    assert next(c for c in honest.checks if c.name == "identity").actual == "both reported"
    stack = stack_factory("http://127.0.0.1:9")
    ready = stack.client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["engine"].startswith("error:"), ready.text


@pytest.fixture
def stack_factory(
    db_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Any]:
    return lambda url: make_stack(db_url, redis_url, url, tmp_path, monkeypatch)
