"""Jobs and object storage (moto's server): a dataset that is a Parquet file in S3 (submitted as its s3://
URI, fetched and converted by the worker that prepares the job) gives the samples of the same job on the
original JSONL file; an output published to ``HSX_OUTPUT_URI`` goes up unit by unit, each shard as its
unit commits and the manifest last, so a consume job (bf16 or fp8, both read as bfloat16) is read
entirely through the store by a consumer that cannot see the workers' disk; a worker killed mid-upload
leaves nothing half-written."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx.loader import iter_samples
from tests.conftest import REDIS_URL
from tests.fixtures.s3 import MIN_PART_BYTES, S3Bucket
from tests.fixtures.stack import REPO, TEST_TOKEN, make_stack
from tests.fixtures.synthetic import Engines, expected_tensors, write_pretokenized

MULTI_TURN = REPO / "tests" / "data" / "short_chats.jsonl"


def test_an_s3_parquet_dataset_gives_the_jsonl_samples_and_the_output_lands_in_s3(
    engine_synthetic: Any, s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = pytest.importorskip("datasets", reason="the interop extra provides datasets for the fixture")
    from hsx.server.db.migrate import upgrade

    parquet = tmp_path / "chats.parquet"
    datasets.Dataset.from_json(str(MULTI_TURN), cache_dir=str(tmp_path / "hf")).to_parquet(str(parquet))
    s3_bucket.client().upload_file(str(parquet), s3_bucket.name, "datasets/chats.parquet")

    db_url = f"sqlite:///{tmp_path / 'hsx.sqlite3'}"
    upgrade(db_url)
    stack = make_stack(
        db_url, REDIS_URL, engine_synthetic.url, tmp_path, monkeypatch,
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


def store_settings(bucket: S3Bucket, **more: str) -> dict[str, str]:
    return {
        "s3_endpoint_url": bucket.server.url,
        "allowed_buckets": bucket.name,
        "output_uri": f"s3://{bucket.name}/outputs",
        **more,
    }


def run_units(engine_url: str, job_id: str, units: int) -> Any:
    """A work horse's own loop, in this process, stopped after ``units`` units: a point the test chooses
    at which the job is still running."""
    from hsx.server.settings import get_settings
    from workers.job_runner import JobRunner

    return JobRunner(job_id, get_settings().model_copy(update={"engine_url": engine_url})).run(units)


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stored(bucket: S3Bucket, prefix: str) -> dict[str, bytes]:
    client = bucket.client()
    return {
        key[len(prefix) :]: client.get_object(Bucket=bucket.name, Key=key)["Body"].read()
        for key in bucket.keys(prefix)
    }


def local(output_dir: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(output_dir).iterdir() if not p.name.startswith(".")}


def open_uploads(bucket: S3Bucket) -> list[str]:
    answer = bucket.client().list_multipart_uploads(Bucket=bucket.name)
    return [u["Key"] for u in answer.get("Uploads", [])]


def tokens_of(index: int, length: int) -> list[int]:
    """Record ``index``'s input_ids as tests.fixtures.synthetic.write_pretokenized writes them."""
    return [3 + (index * 7 + k) % 1000 for k in range(length)]


postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


@postgres_only
def test_a_keep_job_publishes_each_shard_when_its_unit_commits_and_the_manifest_last(
    db_url: str, engines: Engines, s3_bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engines.start()
    stack = make_stack(db_url, REDIS_URL, engine.url, tmp_path, monkeypatch, **store_settings(s3_bucket))
    data = write_pretokenized(tmp_path / "d.jsonl", [40] * 6)
    job_id = stack.submit(data, samples_per_shard=2)["id"]
    prefix = f"outputs/{job_id}/"
    try:
        run_units(engine.url, job_id, 1)
        # The job stopped after its first unit: that unit's shard is in the store, whole, and nothing else.
        doc = stack.job(job_id)
        assert doc["state"] == "running" and doc["progress"]["units_done"] == 1, doc
        assert doc["output"]["uri"] == f"s3://{s3_bucket.name}/outputs/{job_id}", doc["output"]
        first = stored(s3_bucket, prefix)
        assert list(first) == ["shard-00000.safetensors"], first.keys()
        assert (
            first["shard-00000.safetensors"]
            == (Path(doc["output_dir"]) / "shard-00000.safetensors").read_bytes()
        )
        # A reader on another host is told where it is.
        reader = stack.client.post(f"/jobs/{job_id}/consumers", json={"name": "elsewhere"}).json()["id"]
        items = stack.client.post(f"/jobs/{job_id}/consumers/{reader}/leases", json={"max_items": 9}).json()
        assert [i["uri"] for i in items["items"]] == [
            f"s3://{s3_bucket.name}/{prefix}shard-00000.safetensors"
        ]
        # Workers as processes do the rest; finalize has only the manifest left to put.
        assert stack.run_burst(timeout=300) == 0, stack.logs()
        doc = stack.wait(job_id, timeout=120)
    finally:
        stack.stop_workers()
    assert doc["state"] == "succeeded", (doc, stack.logs())
    published, on_disk = stored(s3_bucket, prefix), local(doc["output_dir"])
    assert sorted(published) == sorted(on_disk) == [
        "manifest.json", "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"
    ]  # fmt: skip
    assert {name: sha256_of(b) for name, b in published.items()} == {
        name: sha256_of(b) for name, b in on_disk.items()
    }
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, body in published.items():
        (copy / name).write_bytes(body)
    samples = list(iter_samples(copy))  # every checksum verified against the published manifest
    assert [(s.index, s.input_ids.tolist()) for s in samples] == [(i, tokens_of(i, 40)) for i in range(6)]


class OnAnotherHost:
    """What a consumer on a host that does not mount the workers' output directory is told: each leased
    item's path names a file that is not there (its uri is as the API gave it). Records every item."""

    def __init__(self) -> None:
        self.items: dict[int, dict[str, Any]] = {}

    def __call__(self, answer: dict[str, Any]) -> dict[str, Any]:
        items = [{**item, "path": f"/nonexistent-host-b{item['path']}"} for item in answer["items"]]
        self.items.update((int(item["id"]), item) for item in items)
        return {**answer, "items": items}


@postgres_only
@pytest.mark.parametrize(("state_dtype", "cap"), [("engine", 60_000), ("fp8_e4m3", 40_000)])
def test_a_consume_job_is_read_entirely_through_the_store_and_acknowledged_objects_go(
    db_url: str,
    engines: Engines,
    s3_bucket: S3Bucket,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    state_dtype: str,
    cap: int,
) -> None:
    from torch.utils.data import DataLoader

    from app.main import create_app
    from hsx.torch_data import JobStream, collate_samples
    from tests.fixtures.live_server import serve_in_thread

    host_b = OnAnotherHost()

    class RemoteStream(JobStream):
        def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
            answer = super()._call(method, path, body)
            return host_b(answer) if path.endswith("/leases") else answer

    engine = engines.start()
    stack = make_stack(db_url, REDIS_URL, engine.url, tmp_path, monkeypatch, **store_settings(s3_bucket))
    data = write_pretokenized(tmp_path / "d.jsonl", [48] * 8)
    # About two shards' worth of cap for four shards: the job finishes only as the trainer acknowledges.
    options: dict[str, Any] = {"retention": "consume", "buffer_cap_bytes": cap, "state_dtype": state_dtype}
    job = stack.submit(data, samples_per_shard=2, **options)
    job_id, prefix = job["id"], f"outputs/{job['id']}/"
    seen: list[tuple[int, list[int]]] = []
    held: int | None = None
    try:
        stack.start_worker()
        with serve_in_thread(create_app()) as api:
            stream = RemoteStream(api, job_id, token=TEST_TOKEN, poll_seconds=0.1)
            for batch in DataLoader(stream, batch_size=2, collate_fn=collate_samples):  # a shard a batch
                seen += [
                    (int(i), ids.tolist()) for i, ids in zip(batch["index"], batch["input_ids"], strict=True)
                ]
                for row, ids in enumerate(batch["input_ids"].tolist()):
                    for name, want in expected_tensors(ids, state_dtype).items():
                        assert batch[name].dtype == torch.bfloat16, (name, batch[name].dtype)
                        assert torch.equal(batch[name][row], want), (row, name)
                if held is None:
                    held = int(batch["stream_ref"][0][1])  # never acknowledged: it stays, in the store too
                    continue
                assert stream.ack(batch) == 1
        stack.wait(job_id, timeout=60)
        doc = stack.wait_deleted(job_id)  # by the workers: the last ones at a reconciler pass
    finally:
        stack.stop_workers()
    assert doc["state"] == "succeeded", (doc, stack.logs())
    assert sorted(seen) == [(i, tokens_of(i, 48)) for i in range(8)]  # every sample once, from the store
    assert held is not None and len(host_b.items) == 4
    names = {item_id: item["uri"].rsplit("/", 1)[-1] for item_id, item in host_b.items.items()}
    assert all(item["uri"] == f"s3://{s3_bucket.name}/{prefix}{names[i]}" for i, item in host_b.items.items())
    # Acknowledged: gone from the store and the disk. Not acknowledged: still in both.
    assert sorted(s3_bucket.keys(prefix)) == sorted([f"{prefix}manifest.json", f"{prefix}{names[held]}"])
    for item_id, item in host_b.items.items():
        assert Path(item["path"].removeprefix("/nonexistent-host-b")).exists() == (item_id == held)
    stream_doc = doc["stream"]
    sizes = [s["bytes"] for s in stack.client.get(f"/jobs/{job_id}/shards").json()["items"]]
    assert stream_doc["items_acked"] == 3 and stream_doc["buffered_bytes"] == host_b.items[held]["bytes"]
    assert 0 < max(sizes) * 2 <= cap < sum(sizes), sizes  # the cap held the job back


@postgres_only
def test_a_worker_killed_mid_upload_publishes_nothing_half_written_and_the_job_still_succeeds(
    db_url: str,
    engines: Engines,
    s3_bucket: S3Bucket,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The work horse that committed the job's only unit dies after the first part of the shard's upload.
    Nothing is under the shard's key (an S3 object appears whole or not at all), only an unfinished
    multipart upload; the reconciler finds the committed, unpublished shard, continues that upload
    (reusing the part sent), puts the manifest last, and the job succeeds with every object confirmed."""
    from hsx.server.settings import get_settings
    from workers.reconciler import reconcile_once

    engine = engines.start()
    sizes = {"s3_multipart_threshold_bytes": str(2 * MIN_PART_BYTES), "s3_part_bytes": str(MIN_PART_BYTES)}
    stack = make_stack(
        db_url, REDIS_URL, engine.url, tmp_path, monkeypatch, **store_settings(s3_bucket, **sizes)
    )
    data = write_pretokenized(tmp_path / "d.jsonl", [400] * 4)  # one unit: a shard of about 400 KiB
    job_id = stack.submit(data, samples_per_shard=4)["id"]
    prefix = f"outputs/{job_id}/"
    marker = tmp_path / "crashed"
    # The worker's own reconciler stays out of it (its first pass would come after an hour).
    crash = {
        "HSX_CRASH_AT": "mid_publish",
        "HSX_CRASH_ONCE_FILE": str(marker),
        "HSX_RECONCILE_SECONDS": "3600",
    }
    try:
        assert stack.run_burst(timeout=300, extra_env=crash) == 0, stack.logs()
    finally:
        stack.stop_workers()
    assert marker.exists(), "the work horse died mid-upload"
    doc = stack.job(job_id)
    assert doc["state"] == "running" and doc["progress"]["units_done"] == doc["progress"]["units_total"] == 1
    assert s3_bucket.keys(prefix) == []  # nothing half-written under the shard's key, and no manifest
    assert open_uploads(s3_bucket) == [f"{prefix}shard-00000.safetensors"]
    # Committed but not in the store: no consumer is handed it yet.
    reader = stack.client.post(f"/jobs/{job_id}/consumers", json={"name": "elsewhere"}).json()["id"]
    leases = f"/jobs/{job_id}/consumers/{reader}/leases"
    assert stack.client.post(leases, json={"max_items": 9}).json()["items"] == []

    with caplog.at_level("INFO", logger="hsx.server.jobs"):
        reconcile_once(get_settings())
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", (doc, stack.logs(), caplog.text)
    reused = [
        int(n)
        for n in re.findall(r"published \d+ objects \(\d+ already there, (\d+) parts reused\)", caplog.text)
    ]
    assert sum(reused) >= 1, caplog.text  # the upload was continued, not started again
    assert open_uploads(s3_bucket) == []
    items = stack.client.post(leases, json={"max_items": 9}).json()["items"]
    assert [i["uri"] for i in items] == [f"s3://{s3_bucket.name}/{prefix}shard-00000.safetensors"]
    published, on_disk = stored(s3_bucket, prefix), local(doc["output_dir"])
    assert sorted(published) == sorted(on_disk) == ["manifest.json", "shard-00000.safetensors"]
    assert published == on_disk
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, body in published.items():
        (copy / name).write_bytes(body)
    assert [(s.index, s.input_ids.tolist()) for s in iter_samples(copy)] == [
        (i, tokens_of(i, 400)) for i in range(4)
    ]
