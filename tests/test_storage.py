"""Publishing an output to S3 (moto's server on a loopback port): shards in parts, the manifest last, every
object confirmed, and a process killed mid-upload leaving nothing published that a second run cannot
finish, reusing the parts already there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hsx.loader import iter_samples
from hsx.s3 import StorageError
from hsx.server.settings import Settings
from hsx.server.storage import OutputBucketNotAllowed, OutputUriRefused, UploadEvent, upload_output
from hsx.server.storage.upload import ObjectReport
from tests.fixtures.outputs import OutputSpec, write_output
from tests.fixtures.s3 import MIN_PART_BYTES, S3Bucket

REPO = Path(__file__).resolve().parents[1]
# Shards of about 450 KiB with parts of 64 KiB: 7 or 8 parts each; the manifest goes up in one PUT.
SPEC = OutputSpec(lengths=(300, 280, 320, 260, 310), samples_per_shard=2, hidden_size=96, final_state="both")
SIZES = {"s3_multipart_threshold_bytes": str(128 << 10), "s3_part_bytes": str(MIN_PART_BYTES)}


@pytest.fixture
def output(tmp_path: Path) -> Path:
    directory = tmp_path / "job-out"
    write_output(directory, SPEC)
    return directory


def settings_for(bucket: S3Bucket, tmp_path: Path) -> Settings:
    return bucket.settings(data_dir=tmp_path / "data", **{k: int(v) for k, v in SIZES.items()})


def download(bucket: S3Bucket, prefix: str, into: Path) -> Path:
    client = bucket.client()
    for key in bucket.keys(prefix + "/"):
        target = into / key[len(prefix) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket.name, key, str(target))
    return into


def same_samples(a: Path, b: Path) -> bool:
    left, right = list(iter_samples(a, as_torch=True)), list(iter_samples(b, as_torch=True))
    return len(left) == len(right) and all(
        x.index == y.index
        and torch.equal(x.input_ids, y.input_ids)
        and torch.equal(x.aux_hidden_state, y.aux_hidden_state)
        and torch.equal(x.final_pre_norm, y.final_pre_norm)
        for x, y in zip(left, right, strict=True)
    )


def open_uploads(bucket: S3Bucket) -> list[str]:
    answer = bucket.client().list_multipart_uploads(Bucket=bucket.name)
    return [u["Key"] for u in answer.get("Uploads", [])]


def test_upload_publishes_every_shard_then_the_manifest(
    s3_bucket: S3Bucket, output: Path, tmp_path: Path
) -> None:
    settings = settings_for(s3_bucket, tmp_path)
    events: list[UploadEvent] = []
    report = upload_output(output, f"s3://{s3_bucket.name}/runs/job-1", settings, progress=events.append)
    objects = [event.key for event in events if event.kind == "object"]
    assert objects[-1] == "runs/job-1/manifest.json"  # last
    assert (
        len(objects) == 4 and all(o.parts > 1 for o in report.objects[:-1]) and report.objects[-1].parts == 1
    )
    assert s3_bucket.keys("runs/job-1/") == sorted(objects)
    assert same_samples(output, download(s3_bucket, "runs/job-1", tmp_path / "copy"))
    head = s3_bucket.client().head_object(Bucket=s3_bucket.name, Key=objects[0], ChecksumMode="ENABLED")
    assert head["Metadata"]["hsx-sha256"] == report.objects[0].sha256
    # Again: everything is there and confirmed, nothing is sent.
    again = upload_output(output, f"s3://{s3_bucket.name}/runs/job-1", settings)
    assert all(o.already_there for o in again.objects) and again.bytes_uploaded == 0


def test_a_damaged_remote_object_is_found_and_replaced(
    s3_bucket: S3Bucket, output: Path, tmp_path: Path
) -> None:
    settings = settings_for(s3_bucket, tmp_path)
    uri = f"s3://{s3_bucket.name}/runs/job-2"
    report = upload_output(output, uri, settings)
    victim = report.objects[1]
    client = s3_bucket.client()
    client.put_object(
        Bucket=s3_bucket.name,
        Key=victim.key,
        Body=b"x" * victim.bytes,
        Metadata={"hsx-sha256": victim.sha256, "hsx-part-bytes": str(MIN_PART_BYTES)},
    )
    again = upload_output(output, uri, settings)
    redone = [o.key for o in again.objects if not o.already_there]
    assert redone == [victim.key]
    assert same_samples(output, download(s3_bucket, "runs/job-2", tmp_path / "copy"))


def test_refusals(s3_bucket: S3Bucket, output: Path, tmp_path: Path) -> None:
    settings = settings_for(s3_bucket, tmp_path)
    for uri in (
        f"s3://{s3_bucket.name}",
        f"s3://{s3_bucket.name}/a/../b",
        "file:///tmp/x",
        f"s3://{s3_bucket.name}/p?x=1",
    ):
        with pytest.raises(OutputUriRefused):
            upload_output(output, uri, settings)
    with pytest.raises(OutputBucketNotAllowed):
        upload_output(output, "s3://some-other-bucket/p", settings)
    other = tmp_path / "other-out"
    write_output(other, OutputSpec(seed=5))
    upload_output(other, f"s3://{s3_bucket.name}/taken", settings)
    before = s3_bucket.keys("taken/")
    with pytest.raises(StorageError) as caught:
        upload_output(output, f"s3://{s3_bucket.name}/taken", settings)
    assert caught.value.error == "destination_holds_another_output"
    assert s3_bucket.keys("taken/") == before


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from hsx.server.settings import Settings
    from hsx.server.storage import upload_output

    output_dir, uri, victim, after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    def progress(event):
        # The uploader's own progress hook: the process dies like a worker the kernel killed, mid-object.
        if event.kind == "part" and event.key.endswith(victim) and event.part == after:
            os.kill(os.getpid(), signal.SIGKILL)

    upload_output(output_dir, uri, Settings(), progress=progress)
    """
)


def test_a_process_killed_mid_upload_publishes_nothing_and_a_second_run_finishes(
    s3_bucket: S3Bucket, output: Path, tmp_path: Path
) -> None:
    prefix = "runs/job-3"
    uri = f"s3://{s3_bucket.name}/{prefix}"
    env = {**os.environ, **s3_bucket.env, **{f"HSX_{k.upper()}": v for k, v in SIZES.items()}}
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, str(output), uri, "shard-00001.safetensors", "4"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    keys = s3_bucket.keys(prefix + "/")
    assert f"{prefix}/manifest.json" not in keys  # nothing names an object that is not there
    assert keys == [f"{prefix}/shards/shard-00000.safetensors"]  # the first shard was finished and confirmed
    assert open_uploads(s3_bucket) == [f"{prefix}/shards/shard-00001.safetensors"]

    settings = settings_for(s3_bucket, tmp_path)
    report = upload_output(output, uri, settings)
    by_key = {o.key.rsplit("/", 1)[-1]: o for o in report.objects}
    assert by_key["shard-00000.safetensors"].already_there
    resumed = by_key["shard-00001.safetensors"]
    assert resumed.parts_reused == 4 and resumed.parts_uploaded == resumed.parts - 4
    assert not by_key["shard-00002.safetensors"].already_there
    assert open_uploads(s3_bucket) == []
    assert s3_bucket.keys(prefix + "/")[-1] == f"{prefix}/shards/shard-00002.safetensors"
    assert f"{prefix}/manifest.json" in s3_bucket.keys(prefix + "/")
    assert same_samples(output, download(s3_bucket, prefix, tmp_path / "copy"))


def test_two_publishers_of_one_shard_both_succeed_with_one_whole_object(
    s3_bucket: S3Bucket, output: Path, tmp_path: Path
) -> None:
    """The worker that committed a unit and the reconciler (or finalize) may put one shard at once: the
    second continues the first's multipart upload and completes it, the first then finds its upload gone
    and the object confirmed, and both succeed. A destination holding another output's manifest refuses a
    shard that is not there yet."""
    from hsx.server.storage.publish import put_manifest, put_shard

    settings = settings_for(s3_bucket, tmp_path)
    uri = f"s3://{s3_bucket.name}/runs/job-4"
    relative = "shards/shard-00000.safetensors"
    other: list[ObjectReport] = []

    def interloper(event: UploadEvent) -> None:
        if event.kind == "part" and event.part == 2 and not other:
            other.append(put_shard(output / relative, relative, uri, settings))

    first = put_shard(output / relative, relative, uri, settings, progress=interloper)
    assert other[0].parts_reused == 2 and not other[0].already_there  # it continued the first's upload
    assert first.already_there and first.parts_uploaded == 2  # ... which the first found complete
    assert open_uploads(s3_bucket) == []
    assert s3_bucket.keys("runs/job-4/") == [f"runs/job-4/{relative}"]
    body = s3_bucket.client().get_object(Bucket=s3_bucket.name, Key=f"runs/job-4/{relative}")["Body"].read()
    assert body == (output / relative).read_bytes()

    elsewhere = tmp_path / "other-out"
    write_output(elsewhere, OutputSpec(seed=5))
    put_manifest(elsewhere, f"s3://{s3_bucket.name}/taken", settings)
    with pytest.raises(StorageError) as caught:
        put_shard(output / relative, relative, f"s3://{s3_bucket.name}/taken", settings)
    assert caught.value.error == "destination_holds_another_output"
    assert s3_bucket.keys("taken/") == ["taken/manifest.json"]
