"""A real job whose dataset is a Parquet file in S3 (submitted as its s3:// URI, fetched and converted by the
worker that prepares the job) and whose output is published to S3 by the job's finalization
(``HSX_OUTPUT_URI``; moto's server) gives the samples of the same job on the original JSONL file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx.loader import iter_samples
from tests.conftest import REDIS_URL
from tests.fixtures.s3 import S3Bucket
from tests.fixtures.stack import REPO, make_stack

MULTI_TURN = REPO / "tests" / "data" / "short_chats.jsonl"


def test_an_s3_parquet_dataset_gives_the_jsonl_samples_and_the_output_lands_in_s3(
    engine_nocache: Any, s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = pytest.importorskip("datasets", reason="the interop extra provides datasets for the fixture")
    from hsx.db.migrate import upgrade

    parquet = tmp_path / "chats.parquet"
    datasets.Dataset.from_json(str(MULTI_TURN), cache_dir=str(tmp_path / "hf")).to_parquet(str(parquet))
    s3_bucket.client().upload_file(str(parquet), s3_bucket.name, "datasets/chats.parquet")

    db_url = f"sqlite:///{tmp_path / 'hsx.sqlite3'}"
    upgrade(db_url)
    stack = make_stack(
        db_url, REDIS_URL, engine_nocache.url, tmp_path, monkeypatch,
        s3_endpoint_url=s3_bucket.server.url, allowed_buckets=s3_bucket.name,
        allowed_uri_schemes="file,s3", output_uri=f"s3://{s3_bucket.name}/outputs",
    )  # fmt: skip
    try:
        from_s3 = stack.submit(f"s3://{s3_bucket.name}/datasets/chats.parquet", samples_per_shard=4)
        from_jsonl = stack.submit(MULTI_TURN, samples_per_shard=4)
        assert stack.run_burst(timeout=600) == 0, stack.logs()
        docs = [stack.wait(job["id"], timeout=120) for job in (from_s3, from_jsonl)]
        assert [doc["state"] for doc in docs] == ["succeeded", "succeeded"], stack.logs()
    finally:
        stack.stop_workers()

    # Finalization published the output; the store holds exactly the local output's files.
    copy = tmp_path / "copy"
    client = s3_bucket.client()
    prefix = f"outputs/{from_s3['id']}/"
    local_files = sorted(p.name for p in Path(docs[0]["output_dir"]).iterdir() if not p.name.startswith("."))
    assert sorted(key[len(prefix) :] for key in s3_bucket.keys(prefix)) == local_files
    for key in s3_bucket.keys(prefix):
        (copy / key[len(prefix) :]).parent.mkdir(parents=True, exist_ok=True)
        client.download_file(s3_bucket.name, key, str(copy / key[len(prefix) :]))

    published = list(iter_samples(copy, as_torch=True))  # checksums verified against the manifest
    original = list(iter_samples(docs[1]["output_dir"], as_torch=True))
    assert len(published) == len(original) > 0
    for a, b in zip(published, original, strict=True):
        assert a.index == b.index
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.aux_hidden_state, b.aux_hidden_state)
        assert torch.equal(a.hidden_state, b.hidden_state)  # type: ignore[arg-type]


def test_a_worker_killed_mid_upload_publishes_nothing_half_written_and_the_job_still_succeeds(
    engine_nocache: Any,
    s3_bucket: S3Bucket,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker that finalizes the job dies after the first object is in the store, before the manifest
    (a manifest never names a missing object: tests/test_storage.py shows the store at that moment). The
    next finalize (the next wake-up's, or the reconciler's) resumes the upload, reusing what is there, and
    the job succeeds with every object confirmed."""
    from hsx.db.migrate import upgrade
    from hsx.settings import get_settings
    from workers.reconciler import reconcile_once

    db_url = f"sqlite:///{tmp_path / 'hsx.sqlite3'}"
    upgrade(db_url)
    stack = make_stack(
        db_url, REDIS_URL, engine_nocache.url, tmp_path, monkeypatch,
        s3_endpoint_url=s3_bucket.server.url, allowed_buckets=s3_bucket.name,
        output_uri=f"s3://{s3_bucket.name}/outputs",
    )  # fmt: skip
    marker = tmp_path / "crashed"
    try:
        job = stack.submit(MULTI_TURN, samples_per_shard=4)
        crash = {"HSX_CRASH_AT": "mid_publish", "HSX_CRASH_ONCE_FILE": str(marker)}
        # A work horse finalizes after its last unit, and so does the worker's reconciler thread: whichever
        # gets there first dies, the horse (the worker goes on, exit 0) or the whole worker (exit 137).
        assert stack.run_burst(timeout=600, extra_env=crash) in (0, 137), stack.logs()
    finally:
        stack.stop_workers()
    assert marker.exists(), "the worker died mid-upload"
    prefix = f"outputs/{job['id']}/"
    with caplog.at_level("INFO", logger="hsx.jobs.finalize"):
        reconcile_once(get_settings())  # finalizes, unless the next wake-up already did
    doc = stack.job(job["id"])
    assert doc["state"] == "succeeded", (doc, stack.logs())
    logs = stack.logs() + caplog.text
    resumed = re.findall(r"published (\d+) objects to \S+ \((\d+) already there\)", logs)
    assert resumed and int(resumed[-1][1]) >= 1, "the resumed upload reused the object sent before the crash"
    out = Path(doc["output_dir"])
    local_files = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert sorted(key[len(prefix) :] for key in s3_bucket.keys(prefix)) == local_files
    copy = tmp_path / "copy"
    for key in s3_bucket.keys(prefix):
        (copy / key[len(prefix) :]).parent.mkdir(parents=True, exist_ok=True)
        s3_bucket.client().download_file(s3_bucket.name, key, str(copy / key[len(prefix) :]))
    published = [(s.index, s.input_ids.tolist()) for s in iter_samples(copy)]  # checksums verified
    assert published == [(s.index, s.input_ids.tolist()) for s in iter_samples(out)]
