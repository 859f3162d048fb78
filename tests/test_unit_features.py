"""A job's features register their stage and commit hooks from its plan (workers.features): only those its
options ask for, after-commit work in an order a consumer can rely on, and a failing after-commit hook
neither stops the next nor undoes the commit. (The jobs that run them end to end are tests/test_jobs_e2e,
test_regenerate, test_s3_job and test_stream_items.)"""

from __future__ import annotations

from typing import Any

import pytest

from hsx.contract import EngineInfo
from hsx.engine.client import EngineClient
from hsx.server.job_options import JobOptions, RegenerateOptions
from hsx.server.jobs.repository import ClaimedUnit
from hsx.server.settings import get_settings
from hsx.server.streams.service import record_item
from workers import features
from workers.job_plan import JobPlan, resolve_plan
from workers.job_view import JobView
from workers.regeneration.stage import RegenerateStage
from workers.unit_hooks import FeatureContext, UnitHooks


def plan_of(destination: str = "", **options: Any) -> JobPlan:
    job = JobView(
        state="running",
        options=JobOptions(samples_per_shard=4, **options),
        engine=None,
        dataset_path="/data/d.jsonl",
        output_dir="/out/j",
        records_path="/out/j/records.jsonl",
        records_bytes=100,
        units_total=1,
        destination=destination,
    )
    info = EngineInfo("reference", "/m", 12, 64, "F32", [1, 5, 8], [2, 6, 9, 12], "/dumps", False)
    return resolve_plan(job, info, get_settings())


def installed(plan: JobPlan) -> UnitHooks:
    with EngineClient("http://127.0.0.1:9") as client:  # never called: registering sends nothing
        return features.install(FeatureContext("job-1", get_settings(), plan, client, lambda: None))


def test_a_plain_job_gets_its_stream_items_and_nothing_else() -> None:
    hooks = installed(plan_of())
    assert hooks.stages == []
    assert hooks.in_transaction == [record_item]
    assert [hook.__module__ for hook in hooks.after_commit] == ["workers.features.stream_items"]


def test_a_published_job_puts_its_shard_before_the_item_is_announced() -> None:
    hooks = installed(plan_of(destination="s3://bucket/job-1"))
    # A consumer of a published job is handed a shard once it is in the store: the news comes after.
    modules = [hook.__module__ for hook in hooks.after_commit]
    assert modules == ["workers.features.publication", "workers.features.stream_items"]
    assert hooks.in_transaction == [record_item]


def test_a_regenerate_job_gets_its_stage_before_capture() -> None:
    plan = plan_of(regenerate=RegenerateOptions(max_new_tokens=16))
    assert not plan.records_answered  # its records are prompts: the stage writes the answers
    hooks = installed(plan)
    assert [type(stage) for stage in hooks.stages] == [RegenerateStage]
    assert plan_of().records_answered


def test_a_plan_refuses_a_truncation_policy_it_does_not_know() -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match="truncation"):
        replace(plan_of(), truncation="shorten")


def test_a_failing_after_commit_hook_does_not_stop_the_next() -> None:
    ran: list[str] = []

    def fails(unit: ClaimedUnit) -> None:
        ran.append("fails")
        raise OSError("the store is down")

    hooks = UnitHooks(after_commit=[fails, lambda unit: ran.append("next")])
    unit = ClaimedUnit(1, "job-1", 0, 0, 4, 1, "host:1@x", 0, 100, None, None)
    hooks.committed(unit)
    assert ran == ["fails", "next"]
