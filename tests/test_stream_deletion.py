"""A consume job whose API cannot write the output: it sees it read-only, or does not see it at all (as
docker-compose.yml deploys it, and workers on other hosts have it). The API runs as a process of its own in
a mount namespace of its own (``unshare -m``) with the output bind-mounted read-only, or hidden under an
empty tmpfs; two worker processes and two consumers (threads in this process, over HTTP) run the job.
Every lease and acknowledgement answers 2xx, every sample arrives once and matches the dataset, the
acknowledged shards go (the workers delete them), and the output directory, measured on disk the whole time
(staged shards and temp files included), never holds more than the cap plus one unit.

Real processes, PostgreSQL, Redis, the synthetic engine."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.stack import REPO, TEST_TOKEN, Stack, make_stack
from tests.fixtures.synthetic import Engines, write_pretokenized

pytestmark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
SAMPLES, TOKENS, PER_SHARD = 16, 48, 2
READ_ONLY, UNSEEN = "read-only", "unseen"


@pytest.fixture
def stack(
    db_url: str, redis_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    from hsx.server.settings import get_settings

    engine = engines.start()
    made = make_stack(db_url, redis_url, engine.url, tmp_path, monkeypatch, stream_room_wait_seconds="2")
    try:
        yield made
    finally:
        made.stop_workers()
        get_settings.cache_clear()


def namespaced_api(output: Path, view: str, port_file: Path) -> list[str]:
    """``hsx api`` in a mount namespace of its own, where ``output`` is read-only or hidden. The mounts
    are private to the namespace: the workers, in this one, see the output as it is."""
    from hsx.cli.local_stack import hsx_command

    out = shlex.quote(str(output))
    if view == READ_ONLY:
        mount = f"mount --bind {out} {out} && mount -o remount,bind,ro {out}"
    else:
        mount = f"mount -t tmpfs -o size=1m,mode=0555 hsx-elsewhere {out}"
    api = shlex.join(hsx_command("api", "--port", "0", "--port-file", str(port_file)))
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"{mount} && exec {api}"]


class DiskWatch(threading.Thread):
    """The peak of the bytes in the job's output directory, from the disk itself: every file in it (the
    shards, staged shards, temp files; not the prepared records in their own folder)."""

    def __init__(self, output_dir: Path) -> None:
        super().__init__(daemon=True)
        self.output_dir, self.peak = output_dir, 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.01):
            self.peak = max(self.peak, self.bytes_now())

    def bytes_now(self) -> int:
        total = 0
        try:
            entries = list(os.scandir(self.output_dir))
        except FileNotFoundError:
            return 0
        for entry in entries:
            try:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue  # deleted or renamed between the listing and the stat
        return total


class Consumer(threading.Thread):
    """Leases one shard at a time over HTTP, reads every sample (checked against the item's checksums),
    acknowledges it; records every answer's status and the samples it acknowledged."""

    def __init__(self, api: str, job_id: str, name: str) -> None:
        super().__init__(daemon=True)
        self.http = httpx.Client(
            base_url=f"{api}/jobs/{job_id}", timeout=30, headers={"Authorization": f"Bearer {TEST_TOKEN}"}
        )
        self.consumer_name, self.job_url = name, f"{api}/jobs/{job_id}"
        self.statuses: list[tuple[str, int]] = []
        self.samples: dict[int, list[int]] = {}
        self.error: BaseException | None = None

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = self.http.post(path, json=body)
        self.statuses.append((path.rsplit("/", 1)[-1], resp.status_code))
        assert resp.is_success, f"{path}: {resp.status_code} {resp.text}"
        return dict(resp.json())

    def run(self) -> None:
        from hsx.streams.reader import item_samples, manifest_for

        try:
            cid = self.call("/consumers", {"name": self.consumer_name, "group": "trainer"})["id"]
            manifest = None
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                answer = self.call(f"/consumers/{cid}/leases", {"max_items": 1})
                assert answer["job_state"] not in ("failed", "cancelled"), answer
                for item in answer["items"]:
                    if manifest is None:
                        manifest = manifest_for(self.http.get(self.job_url).json())
                    for sample in item_samples(item, manifest):
                        self.samples[sample.index] = [int(t) for t in sample.input_ids]
                    done = self.call(
                        f"/consumers/{cid}/acks",
                        {"items": [{"id": item["id"], "delivery": item["delivery"]}]},
                    )
                    assert done["acked"] == [item["id"]], done
                if answer["end_of_stream"]:
                    return
                if not answer["items"]:
                    time.sleep(0.05)
            raise AssertionError("the stream did not end")
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def can_unshare() -> bool:
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.parametrize("view", [READ_ONLY, UNSEEN])
def test_a_consume_job_whose_api_cannot_write_or_see_the_output_streams_and_its_shards_go(
    stack: Stack, view: str
) -> None:
    from hsx.cli.local_stack import local_stack, wait_http, wait_port_file

    if not can_unshare():
        pytest.skip("needs `unshare --mount` (root, or CAP_SYS_ADMIN) to give the API its own view")
    dataset = write_pretokenized(stack.tmp / "d.jsonl", [TOKENS] * SAMPLES)
    records = [json.loads(line) for line in dataset.read_text().splitlines()]
    output_root = Path(stack.env["HSX_OUTPUT_DIR"])
    output_root.mkdir(parents=True, exist_ok=True)
    port_file = stack.tmp / "api-port"
    with local_stack(stack.tmp / "api-logs") as procs:
        proc = procs.start(
            "api", namespaced_api(output_root, view, port_file), env={**stack.env, "PYTHONPATH": str(REPO)}
        )
        api = f"http://127.0.0.1:{wait_port_file(port_file, 60, proc)}"
        wait_http(f"{api}/healthz", 60, proc)
        http = httpx.Client(base_url=api, timeout=30, headers={"Authorization": f"Bearer {TEST_TOKEN}"})
        unit = 2 * TOKENS * 4 * 32 * 2 * PER_SHARD // 2  # a shard's states, roughly: to scale the cap by
        cap = int(unit * 2.5)
        options = {"samples_per_shard": PER_SHARD, "retention": "consume", "buffer_cap_bytes": cap}
        submitted = http.post("/jobs", json={"dataset_uri": str(dataset), "options": options})
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["id"]
        output_dir = output_root / job_id
        watch = DiskWatch(output_dir)
        watch.start()
        for _ in range(2):
            stack.start_worker()
        consumers = [Consumer(api, job_id, f"rank{n}") for n in range(2)]
        for consumer in consumers:
            consumer.start()
        # The API's view of the output is what this test says it is, read through its own mount namespace.
        wait_for(output_dir.is_dir, 120, "the job's output directory", stack)
        api_view = Path(f"/proc/{proc.pid}/root{output_dir}")
        if view == READ_ONLY:
            assert api_view.is_dir() and read_only_mount(proc.pid, output_root)
        else:
            assert not api_view.exists()
        for consumer in consumers:
            consumer.join(240)
        for consumer in consumers:
            assert consumer.error is None, (consumer.error, stack.logs())

        # The last shards were acknowledged after the job succeeded: a worker host's reconciler deletes them.
        # A deletion is recorded just after its file goes, so wait for the record, not only the file.
        def deleted() -> bool:
            stored = http.get(f"/jobs/{job_id}").json()["stream"]["stored_bytes"]
            return not list(output_dir.glob("shard-*")) and stored == 0

        wait_for(deleted, 60, "the acknowledged shards gone and recorded", stack)
        watch.stopped.set()
        watch.join()
        doc = http.get(f"/jobs/{job_id}").json()
        shards = http.get(f"/jobs/{job_id}/shards").json()["items"]
    assert doc["state"] == "succeeded", (doc, stack.logs())
    calls = [s for c in consumers for s in c.statuses]
    assert {name for name, _ in calls} >= {"leases", "acks"} and all(200 <= s < 300 for _, s in calls), calls
    got = {index: ids for c in consumers for index, ids in c.samples.items()}
    assert sum(len(c.samples) for c in consumers) == SAMPLES and sorted(got) == list(range(SAMPLES))
    assert all(got[i] == records[i]["input_ids"] for i in range(SAMPLES))
    stream = doc["stream"]
    assert stream["items_acked"] == len(shards) == SAMPLES // PER_SHARD, stream
    assert stream["stored_bytes"] == stream["buffered_bytes"] == 0, stream
    largest = max(s["bytes"] for s in shards)
    assert cap < SAMPLES // PER_SHARD * largest  # the job's output does not fit under its cap
    assert 0 < watch.peak <= cap + largest, (watch.peak, cap, largest)


def read_only_mount(pid: int, path: Path) -> bool:
    """Whether ``path`` is a mount point in the process's namespace with the ro option."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            return "ro" in fields[5].split(",")
    return False


def wait_for(check: Any, timeout: float, what: str, stack: Stack) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{stack.logs()}"
        time.sleep(0.05)
