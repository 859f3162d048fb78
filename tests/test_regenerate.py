"""Regenerate jobs (docs/regenerate.md): the option's validation, turn-by-turn generation whose ids are the
engine's own, the exactly-once text (a worker killed between generation and capture), accounting, and the
regenerated dataset as an output that re-captures bit for bit. Real reference engine (small
max_new_tokens), real PostgreSQL and Redis, real worker processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from tests.fixtures.stack import REPO, Stack, make_stack

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
FAST = {"lease_seconds": "3", "heartbeat_seconds": "0.5", "reconcile_seconds": "0.5"}

TOOL_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
}
ROWS: list[Any] = [
    {
        "id": "plain",
        "messages": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4"}],
    },
    {
        "id": "two-turns",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Blue."},
        ],
    },
    {
        "id": "tool",
        "messages": [
            {"role": "user", "content": "Add 2 and 3."},
            TOOL_CALL,
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "It is 5."},
        ],
    },
    {
        "id": "ends-on-user",
        "messages": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Count to three."},
        ],
    },
    {"id": "prompt-only", "messages": [{"role": "user", "content": "Name a fruit."}]},
    "not json",
    {"id": "pretokenized", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
]
KEPT = ("plain", "two-turns", "tool", "ends-on-user", "prompt-only")


def write_rows(path: Path, rows: list[Any]) -> Path:
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def shard_samples(output_dir: str) -> dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    from hsx.loader import iter_samples

    return {s.index: (s.input_ids, s.loss_mask) for s in iter_samples(output_dir, verify_checksums=True)}


def download(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    response = stack.client.get(f"/jobs/{job_id}/regenerated")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def kept_rows(db_url: str, job_id: str) -> dict[int, Any]:
    from sqlalchemy import select

    from hsx.db.session import session_scope
    from hsx.regenerate.models import RegeneratedSample

    with session_scope(db_url) as session:
        rows = session.scalars(select(RegeneratedSample).where(RegeneratedSample.job_id == job_id))
        return {r.sample_index: (r.attempt, r.reason, list(r.input_ids or [])) for r in rows}


# --- the option ---------------------------------------------------------------------------------------------


def test_the_option_is_off_by_default_and_strict() -> None:
    from hsx.job_options import JobOptions

    assert JobOptions().regenerate is None
    options = JobOptions.model_validate({"regenerate": {"turns": "last", "temperature": 1, "seed": 3}})
    assert options.regenerate is not None and options.regenerate.temperature == 1.0
    assert JobOptions.from_stored(options.stored()) == options
    for bad in (
        {"turns": "first"},
        {"max_new_tokens": 0},
        {"temperature": 2.5},
        {"top_p": 0},
        {"seed": -1},
        {"on_length": "truncate"},
        {"typo": 1},
        {"max_new_tokens": "16"},
    ):
        with pytest.raises(ValidationError):
            JobOptions.model_validate({"regenerate": bad})
    with pytest.raises(ValidationError, match="chat_template"):
        JobOptions.model_validate({"regenerate": {}, "chat_template": False})


@postgres_only
def test_a_bad_regenerate_option_is_a_422_naming_the_field(
    db_url: str, redis_url: str, engine_synthetic: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = make_stack(db_url, redis_url, engine_synthetic.url, tmp_path, monkeypatch)
    dataset = write_rows(tmp_path / "rows.jsonl", ROWS[:1])
    for bad, field in (
        ({"top_p": 1.5}, "top_p"),
        ({"nope": 1}, "nope"),
        ({"max_new_tokens": -4}, "max_new_tokens"),
    ):
        response = stack.client.post(
            "/jobs", json={"dataset_uri": str(dataset), "options": {"regenerate": bad}}
        )
        assert response.status_code == 422, response.text
        body = response.json()
        assert (
            set(body) >= {"error", "detail"} and "regenerate" in body["detail"] and field in body["detail"]
        ), body
    # A plain job's document has no regenerate section; asking for the download of one is a 409.
    doc = stack.submit(dataset)
    assert doc["regenerate"] is None and doc["options"]["regenerate"] is None
    refused = stack.client.get(f"/jobs/{doc['id']}/regenerated")
    assert refused.status_code == 409 and refused.json()["error"] == "not_regenerated", refused.text


# --- composes with the other options ----------------------------------------------------------------------


def test_a_regenerate_job_reads_parquet_from_s3_keeps_fp8_states_and_publishes_to_s3(
    engine_synthetic: Any, s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regeneration changes what capture is given, not how it is read, stored or published: a Parquet
    dataset in the object store, fp8 states, the output published to the store (synthetic engine: no model
    value is checked here)."""
    datasets = pytest.importorskip("datasets", reason="the interop extra provides datasets for the fixture")
    from hsx.db.migrate import upgrade
    from tests.conftest import REDIS_URL

    chats = REPO / "tests" / "data" / "short_chats.jsonl"
    parquet = tmp_path / "chats.parquet"
    datasets.Dataset.from_json(str(chats), cache_dir=str(tmp_path / "hf")).to_parquet(str(parquet))
    s3_bucket.client().upload_file(str(parquet), s3_bucket.name, "datasets/chats.parquet")
    db_url = f"sqlite:///{tmp_path / 'hsx.sqlite3'}"
    upgrade(db_url)
    stack = make_stack(
        db_url, REDIS_URL, engine_synthetic.url, tmp_path, monkeypatch,
        s3_endpoint_url=s3_bucket.server.url, allowed_buckets=s3_bucket.name,
        allowed_uri_schemes="file,s3", output_uri=f"s3://{s3_bucket.name}/outputs",
    )  # fmt: skip
    try:
        options = {
            "samples_per_shard": 5,
            "state_dtype": "fp8_e4m3",
            "regenerate": {"seed": 11, "max_new_tokens": 8},
        }
        job = stack.submit(f"s3://{s3_bucket.name}/datasets/chats.parquet", **options)
        assert stack.run_burst(timeout=300) == 0, stack.logs()
        doc = stack.wait(job["id"], timeout=120)
        assert doc["state"] == "succeeded", (doc, stack.logs())
        lines = download(stack, doc["id"])
    finally:
        stack.stop_workers()
    total = sum(1 for line in chats.read_text().splitlines() if line.strip())
    regen = doc["regenerate"]
    assert regen["samples_regenerated"] + regen["samples_failed"] == total == doc["progress"]["samples_total"]
    assert doc["progress"]["samples_done"] == regen["samples_regenerated"] == len(lines) > 0
    assert all(line["generation"]["seeds"] and None not in line["generation"]["seeds"] for line in lines)

    copy = tmp_path / "copy"
    prefix = f"outputs/{doc['id']}/"
    for key in s3_bucket.keys(prefix):
        (copy / key[len(prefix) :]).parent.mkdir(parents=True, exist_ok=True)
        s3_bucket.client().download_file(s3_bucket.name, key, str(copy / key[len(prefix) :]))
    from hsx.loader import iter_samples

    published = {s.index: s for s in iter_samples(copy, raw_fp8=True)}  # checksums against the manifest
    assert sorted(published) == [line["sample_index"] for line in lines]
    for line in lines:
        sample = published[line["sample_index"]]
        assert (
            sample.input_ids.tolist() == line["input_ids"] and sample.loss_mask.tolist() == line["loss_mask"]
        )
        assert (
            str(sample.hidden_state.dtype).endswith("float8_e4m3fn")
            or sample.hidden_state.dtype.itemsize == 1
        )
