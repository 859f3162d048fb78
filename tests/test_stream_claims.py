"""What docs/streaming.md says of publication and retention, each claim run against a real job (synthetic
engine, PostgreSQL, Redis, moto's S3 server behind a proxy the test cuts to make the store unreachable):

* a shard its committer could not publish is published by the reconciler once it was committed more than
  a unit lease ago, not before (the test says when that is, through the reconciler's clock);
* an unreachable store leaves a finished job running, and it succeeds once the store answers again;
* a store that refuses for good (another output's manifest at the destination) fails the job, and the
  failed consume job keeps every unacknowledged shard;
* a cancelled consume job keeps its unacknowledged shards, leased or not;
* an object delete that failed is tried again: the object goes once the store answers;
* ``open_item(..., source="s3")`` reads the object even where the file is, ``source="file"`` the file even
  where the object is, each failing with ``ShardGone`` where its own copy is not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REDIS_URL
from tests.fixtures.cuttable_proxy import CuttableProxy
from tests.fixtures.s3 import S3Bucket
from tests.fixtures.sample_records import record_of_sample
from tests.fixtures.stack import Stack, make_stack
from tests.fixtures.synthetic import Engines, write_pretokenized
from tests.test_faults import wait_until

pytestmark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


@pytest.fixture
def proxy(s3_bucket: S3Bucket) -> Iterator[CuttableProxy]:
    port = int(s3_bucket.server.url.rsplit(":", 1)[1])
    store = CuttableProxy(port)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def stack(
    db_url: str,
    engines: Engines,
    s3_bucket: S3Bucket,
    proxy: CuttableProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Stack]:
    """A stack whose every process reaches the store through the proxy, jobs published to it."""
    from hsx.server.settings import get_settings

    settings = {
        "s3_endpoint_url": proxy.url,
        "allowed_buckets": s3_bucket.name,
        "output_uri": f"s3://{s3_bucket.name}/outputs",
    }
    s = make_stack(db_url, REDIS_URL, engines.start().url, tmp_path, monkeypatch, **settings)
    try:
        yield s
    finally:
        s.stop_workers()
        get_settings.cache_clear()


def run_units(units: int, job_id: str) -> None:
    """A work horse's own loop in this process, stopped after ``units`` units (the job's last commit
    finalizes it)."""
    from hsx.server.settings import get_settings
    from workers.job_runner import JobRunner

    JobRunner(job_id, get_settings()).run(units)


def reconcile(now: float | None = None) -> dict[str, int]:
    from hsx.server.settings import get_settings
    from workers.reconciler import reconcile_once

    return reconcile_once(get_settings(), now)


def keys(bucket: S3Bucket, job_id: str) -> list[str]:
    prefix = f"outputs/{job_id}/"
    return [key[len(prefix) :] for key in bucket.keys(prefix)]


def shards(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    answer = stack.client.get(f"/jobs/{job_id}/shards", params={"limit": 1000})
    assert answer.status_code == 200, answer.text
    return list(answer.json()["items"])


def consumer(stack: Stack, job_id: str) -> str:
    answer = stack.client.post(f"/jobs/{job_id}/consumers", json={"name": "claims", "lease_seconds": 300})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def lease(stack: Stack, job_id: str, reader: str, n: int) -> list[dict[str, Any]]:
    answer = stack.client.post(f"/jobs/{job_id}/consumers/{reader}/leases", json={"max_items": n})
    assert answer.status_code == 200, answer.text
    return list(answer.json()["items"])


def ack(stack: Stack, job_id: str, reader: str, item: dict[str, Any]) -> dict[str, Any]:
    body = {"items": [{"id": item["id"], "delivery": item["delivery"]}]}
    answer = stack.client.post(f"/jobs/{job_id}/consumers/{reader}/acks", json=body)
    assert answer.is_success, answer.text  # 2xx whether or not the store deleted the object
    return dict(answer.json())


def test_a_straggler_is_published_by_age_and_an_unreachable_store_leaves_the_job_running(
    stack: Stack, s3_bucket: S3Bucket, proxy: CuttableProxy
) -> None:
    from hsx.loader import iter_samples

    data = write_pretokenized(stack.tmp / "d.jsonl", [48] * 4)
    job_id = stack.submit(data, samples_per_shard=2)["id"]  # two units
    proxy.cut()
    run_units(1, job_id)  # the first unit commits; its committer cannot publish it
    assert stack.job(job_id)["progress"]["units_done"] == 1 and keys(s3_bucket, job_id) == []
    proxy.restore()
    # Committed less than a unit lease ago: its committer may still be at it, so the reconciler waits.
    assert reconcile()["published"] == 0 and keys(s3_bucket, job_id) == []
    older = shards(stack, job_id)[0]
    lease_later = time.time() + stack.settings.lease_seconds + 1
    assert reconcile(now=lease_later)["published"] == 1
    assert keys(s3_bucket, job_id) == [Path(older["path"]).name]
    # The last unit commits while the store is unreachable: the job cannot be published, so it runs on.
    proxy.cut()
    run_units(1, job_id)
    reconcile()  # a reconciler pass that meets no store finishes (the jobs after this one get theirs)
    doc = stack.job(job_id)
    assert doc["state"] == "running" and doc["progress"]["units_done"] == 2 and not doc["error"], doc
    assert keys(s3_bucket, job_id) == [Path(older["path"]).name]
    proxy.restore()
    reconcile()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", doc
    names = sorted(Path(s["path"]).name for s in shards(stack, job_id))
    assert keys(s3_bucket, job_id) == sorted(["manifest.json", *names])
    copy = stack.tmp / "copy"
    copy.mkdir()
    client = s3_bucket.client()
    for name in keys(s3_bucket, job_id):
        client.download_file(s3_bucket.name, f"outputs/{job_id}/{name}", str(copy / name))
    lines = [json.loads(line) for line in data.read_text().splitlines()]
    read = [(s.index, s.input_ids.tolist()) for s in iter_samples(copy, verify_checksums=True)]
    assert read == [(i, line["input_ids"]) for i, line in enumerate(lines)]


def test_a_refusing_store_fails_the_job_which_keeps_its_unacknowledged_shards(
    stack: Stack, s3_bucket: S3Bucket
) -> None:
    data = write_pretokenized(stack.tmp / "d.jsonl", [48] * 4)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume", buffer_cap_bytes=10**9)["id"]
    # Another output's manifest is already at the job's destination: the store refuses it for good.
    other = json.dumps({"job_id": "another-output", "shards": []}).encode()
    s3_bucket.client().put_object(Bucket=s3_bucket.name, Key=f"outputs/{job_id}/manifest.json", Body=other)
    run_units(2, job_id)
    reconcile()
    doc = stack.job(job_id)
    assert doc["state"] == "failed" and "another output" in doc["error"], doc
    assert keys(s3_bucket, job_id) == ["manifest.json"]
    reconcile()
    committed = shards(stack, job_id)
    assert len(committed) == 2 and all(Path(s["path"]).exists() for s in committed), committed


def test_a_cancelled_consume_job_keeps_its_unacknowledged_shards(stack: Stack) -> None:
    from hsx.server.db.session import session_scope
    from hsx.server.streams.item_counts import buffered_bytes

    data = write_pretokenized(stack.tmp / "d.jsonl", [48] * 8)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume", buffer_cap_bytes=10**9)["id"]
    run_units(3, job_id)
    reader = consumer(stack, job_id)
    used, held = lease(stack, job_id, reader, 2)
    assert ack(stack, job_id, reader, used)["acked"] == [used["id"]]
    assert stack.client.post(f"/jobs/{job_id}/cancel").status_code == 200
    # The reader goes away and its lease runs out; the reconciler passes: none of it deletes a shard.
    assert stack.client.delete(f"/jobs/{job_id}/consumers/{reader}").status_code == 204
    reconcile()
    doc = stack.job(job_id)
    assert doc["state"] == "cancelled", doc
    unacknowledged = [s for s in shards(stack, job_id) if s["path"] != used["path"]]
    assert len(unacknowledged) == 2 and held["path"] in {s["path"] for s in unacknowledged}
    assert all(Path(s["path"]).exists() for s in unacknowledged), unacknowledged
    with session_scope(stack.env["HSX_DATABASE_URL"]) as session:
        assert buffered_bytes(session, job_id) >= sum(s["bytes"] for s in unacknowledged)


def test_an_object_delete_that_failed_is_tried_again(
    stack: Stack, s3_bucket: S3Bucket, proxy: CuttableProxy
) -> None:
    data = write_pretokenized(stack.tmp / "d.jsonl", [48] * 4)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume", buffer_cap_bytes=10**9)["id"]
    stack.start_worker()  # whoever deletes acknowledged shards, a worker is there
    doc = stack.wait(job_id, timeout=120)
    assert doc["state"] == "succeeded", (doc, stack.logs())
    reader = consumer(stack, job_id)
    item = lease(stack, job_id, reader, 1)[0]
    name = Path(item["path"]).name
    assert item["uri"] == f"s3://{s3_bucket.name}/outputs/{job_id}/{name}"
    proxy.cut()
    assert ack(stack, job_id, reader, item)["acked"] == [item["id"]]
    assert name in keys(s3_bucket, job_id)  # the store was not there to delete it
    proxy.restore()

    def gone() -> bool:
        lease(stack, job_id, reader, 1)  # the next stream call, in case it is the one that retries
        return name not in keys(s3_bucket, job_id) and not Path(item["path"]).exists()

    wait_until(gone, 60, "the acknowledged shard's object and file to go", stack)
    assert sorted(keys(s3_bucket, job_id)) == sorted(
        ["manifest.json", *(Path(s["path"]).name for s in shards(stack, job_id) if s["path"] != item["path"])]
    )


def test_a_reader_takes_each_copy_from_the_source_it_names(
    stack: Stack, s3_bucket: S3Bucket, proxy: CuttableProxy
) -> None:
    from hsx.loader import iter_samples
    from hsx.streams.reader import ShardGone, manifest_for, open_item

    def records(item: dict[str, Any], source: str) -> list[dict[str, Any]]:
        view = open_item(item, manifest, verify=True, source=source)  # type: ignore[arg-type]
        return [record_of_sample(view.sample(k)) for k in range(len(view))]

    data = write_pretokenized(stack.tmp / "d.jsonl", [48] * 4)
    job_id = stack.submit(data, samples_per_shard=2)["id"]
    run_units(2, job_id)
    reconcile()  # finalizes it
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", doc
    written = {s.index: record_of_sample(s) for s in iter_samples(doc["output_dir"], verify_checksums=True)}
    manifest = manifest_for(doc)
    reader = consumer(stack, job_id)
    first, second = lease(stack, job_id, reader, 2)
    # The first shard's file moves away: "s3" and "auto" read the object, "file" finds nothing.
    Path(first["path"]).rename(stack.tmp / "moved.safetensors")
    assert records(first, "s3") == records(first, "auto") == [written[0], written[1]]
    with pytest.raises(ShardGone):
        records(first, "file")
    # The second shard's object goes: "file" and "auto" read the file, "s3" finds nothing, even with the
    # file there.
    s3_bucket.client().delete_object(
        Bucket=s3_bucket.name, Key=f"outputs/{job_id}/{Path(second['path']).name}"
    )
    assert records(second, "file") == records(second, "auto") == [written[2], written[3]]
    with pytest.raises(ShardGone):
        records(second, "s3")
