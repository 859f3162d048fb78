"""``hsx feed specforge`` feeds a running job into SpecForge 0.2.0's own disaggregated stream, and
SpecForge's own consumer classes read it with no hsx code on their side: ``StreamingRefChannel`` /
``StreamingRefQueue`` (poll, get, ack), ``SharedDirFeatureStore`` (get, release) and ``FeatureDataLoader``
with the EAGLE-3 streaming provider's collator.

Real reference engine, real worker process, real API over HTTP, PostgreSQL and Redis. Every tensor the
trainer gets is compared with the hsx shard it came from (read with hsx's own numpy reader while the shard
is still there) and with the dataset's tokens, for a job in the engine's dtype and for an fp8 one (whose
states the trainer gets as bfloat16, as from every other reader). The consume job runs with a cap of one
byte, so hsx works one unit at a time: the job only finishes because SpecForge's consumed counter lets the
feeder acknowledge.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.ports import reserved_port
from tests.fixtures.stack import REPO, TEST_TOKEN, Stack
from tests.fixtures.synthetic import write_pretokenized

pytest.importorskip("specforge.runtime.data_plane.streaming_ref_channel")

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def _mooncake_missing() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (
            f"Mooncake is not importable here ({exc}): pip install mooncake-transfer-engine-non-cuda; even "
            "on TCP it needs libibverbs.so.1 and libnl-3 (docs/streaming.md)"
        )
    return None


MOONCAKE_MISSING = _mooncake_missing()
STORE_ID = "hsx-stream"


class FeederThread:
    """The feeder as ``hsx feed specforge`` runs it, in a thread of the test."""

    def __init__(
        self, api: str, job_id: str, tmp: Path, window: int, stop_after: int | None = None, sink: Any = None
    ) -> None:
        from hsx.integrations.specforge.feeder import SpecForgeFeeder

        self.feeder = SpecForgeFeeder(
            api_url=api,
            job_id=job_id,
            channel_path=tmp / "control" / "refs.jsonl",
            store_root=tmp / "features",
            store_id=STORE_ID,
            token=TEST_TOKEN,
            window=window,
            poll_seconds=0.1,
            should_stop=(lambda: False)
            if stop_after is None
            else (lambda: self.feeder.channel.appended >= stop_after),
            sink=sink,
        )
        # Passes of the feeder's loop that found its window full (it asks the job whether it broke instead
        # of leasing): after one, a feeder that would go past its window has had its chance to.
        self.full_window_passes = 0
        ended = self.feeder._ended

        def counted() -> str | None:
            self.full_window_passes += 1
            return ended()

        self.feeder._ended = counted  # type: ignore[method-assign]
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.feeder.run()
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    def join(self, timeout: float = 120) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "feeder did not finish"
        if self.error is not None:
            raise self.error
        return self.result


# The tensor dtype every torch reader gives for a manifest's dtype (fp8 comes dequantized to bf16).
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.bfloat16}


class HsxShards:
    """What hsx wrote, by sample index, read with hsx's numpy reader (states as float32) from the job's
    committed shards, as the tensors a torch reader must give: states in the manifest dtype's torch
    dtype."""

    def __init__(self, stack: Stack, job_id: str) -> None:
        self.stack, self.job_id = stack, job_id
        self.samples: dict[int, dict[str, torch.Tensor]] = {}
        self.read: set[str] = set()

    def get(self, index: int) -> dict[str, torch.Tensor]:
        if index not in self.samples:
            self._read_new()
        return self.samples[index]

    def _read_new(self) -> None:
        from hsx.streams.reader import manifest_for, open_item

        doc = self.stack.job(self.job_id)
        manifest = manifest_for(doc)
        self.dtype = TORCH_DTYPES[manifest.dtype]
        shards = self.stack.client.get(f"/jobs/{self.job_id}/shards", params={"limit": 1000}).json()["items"]
        for entry in shards:
            path = Path(doc["output_dir"]) / entry["path"]
            if entry["path"] in self.read or not path.exists():
                continue
            # The shard listing carries no header checksum; the feeder checked both when it leased it.
            view = open_item({**entry, "path": str(path)}, manifest, verify=False)
            for sample in (view.sample(k) for k in range(len(view))):
                self.samples[sample.index] = {
                    "input_ids": torch.from_numpy(sample.input_ids).long(),
                    "loss_mask": torch.from_numpy(sample.loss_mask).long(),
                    "hidden_state": torch.from_numpy(sample.hidden_state).to(self.dtype),
                    "aux_hidden_state": torch.from_numpy(sample.aux_hidden_state).to(self.dtype),
                }
            self.read.add(entry["path"])


def specforge_loader(tmp: Path, idle_timeout: float = 180, store: Any = None) -> Any:
    """SpecForge's trainer-side stack, as its disaggregated consumer builds it, pointed at our files."""
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.runtime.data_plane.disaggregated import SharedDirFeatureStore
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel, StreamingRefQueue

    channel = StreamingRefChannel(str(tmp / "control" / "refs.jsonl"))
    queue = StreamingRefQueue(channel, poll_s=0.05, idle_timeout_s=idle_timeout)
    if store is None:
        store = SharedDirFeatureStore(str(tmp / "features"), store_id=STORE_ID)  # release frees the file
    collate = algorithm_providers().server_streaming_for("text").build_collator()
    return FeatureDataLoader(store, queue, batch_size=1, collate_fn=collate, strategy="eagle3"), channel


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A real mooncake_master on loopback ports kept for it (it cannot bind port 0 and say which it got),
    its HTTP metadata server inside (no etcd)."""
    with reserved_port() as rpc, reserved_port() as http, reserved_port() as metrics:
        yield from _mooncake_master(tmp_path, rpc, http, metrics)


def _mooncake_master(tmp_path: Path, rpc: int, http: int, metrics: int) -> Iterator[dict[str, Any]]:
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    with open(tmp_path / "mooncake-master.log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(binary),
                f"--rpc_port={rpc}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={http}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "mooncake-master.log").read_text(errors="replace")[-2000:]
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", http), timeout=1):
                break
            assert time.monotonic() < deadline, "mooncake_master did not start"
            time.sleep(0.2)
        kw = {
            "local_hostname": "127.0.0.1",
            "metadata_server": f"http://127.0.0.1:{http}/metadata",
            "master_server_addr": f"127.0.0.1:{rpc}",
            "global_segment_size": 64 << 20,
            "local_buffer_size": 64 << 20,
            "protocol": "tcp",
            "rdma_devices": "",
        }
        yield kw
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.fixture
def api(stack: Stack) -> Iterator[str]:
    from app.main import create_app

    with serve_in_thread(create_app()) as url:
        yield url


@postgres_only
@pytest.mark.parametrize("state_dtype", ["engine", "fp8_e4m3"])
@pytest.mark.parametrize(
    "backend",
    [
        "shared_dir",
        pytest.param(
            "mooncake", marks=pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=str(MOONCAKE_MISSING))
        ),
    ],
)
def test_specforge_reads_a_running_job_with_every_tensor_as_hsx_wrote_it(
    stack: Stack, api: str, tmp_path: Path, backend: str, state_dtype: str, request: pytest.FixtureRequest
) -> None:
    from specforge.algorithms.eagle3.providers import algorithm_spec

    sink = store = None
    if backend == "mooncake":
        from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

        from hsx.integrations.specforge.mooncake import MooncakeFeatures, MooncakeSetup

        kw = request.getfixturevalue("mooncake_master")
        setup = MooncakeSetup(kw["master_server_addr"], kw["metadata_server"], segment_bytes=64 << 20)
        sink = MooncakeFeatures(setup, STORE_ID)
        store = MooncakeFeatureStore(store_id=STORE_ID, setup_kwargs=kw)  # SpecForge's own client
    data = write_pretokenized(tmp_path / "d.jsonl", [24, 31, 17, 40, 24, 29])
    options: dict[str, Any] = {"retention": "consume", "buffer_cap_bytes": 1, "state_dtype": state_dtype}
    job_id = stack.submit(data, samples_per_shard=2, **options)["id"]
    stack.start_worker()
    feeder = FeederThread(api, job_id, tmp_path, window=2, sink=sink)
    loader, _ = specforge_loader(tmp_path, store=store)
    required = next(
        c.required_tensors for c in algorithm_spec().feature_contracts if c.mode.value == "streaming"
    )

    # The trainer has not read anything: the feeder holds one shard (its window, two refs) and hsx holds
    # its workers back, since that unacknowledged shard fills the cap.
    refs_file = tmp_path / "control" / "refs.jsonl"
    deadline = time.monotonic() + 240
    while not feeder.full_window_passes:
        assert feeder.thread.is_alive(), feeder.error
        assert time.monotonic() < deadline, (stack.job(job_id), stack.logs())
        time.sleep(0.05)
    assert len(records(refs_file)) == 2, "the feeder went past its window"
    assert stack.job(job_id)["stream"]["waiting_on_consumers"], stack.job(job_id)["stream"]

    hsx = HsxShards(stack, job_id)
    seen: list[int] = []
    for batch in loader:
        assert required <= set(batch.tensors), batch.tensors.keys()
        assert batch.metadata["target_repr"] == "hidden_state"
        (sid,) = batch.sample_ids
        index = int(sid.rsplit(":", 1)[1])
        want = hsx.get(index)  # the shard is there: the feeder has not acknowledged it yet
        got = batch.tensors
        assert torch.equal(got["input_ids"], want["input_ids"].unsqueeze(0))
        assert torch.equal(got["loss_mask"], want["loss_mask"].unsqueeze(0))
        assert torch.equal(got["attention_mask"], torch.ones_like(got["input_ids"]))
        assert got["hidden_state"].dtype == got["target"].dtype == hsx.dtype
        assert torch.equal(got["hidden_state"], want["aux_hidden_state"].unsqueeze(0))
        assert torch.equal(got["target"], want["hidden_state"].unsqueeze(0))
        assert got["target"].shape[-1] * 3 == got["hidden_state"].shape[-1]
        assert got["input_ids"][0].tolist() == records(data)[index]["input_ids"]
        buffered = stack.job(job_id)["stream"]
        # hsx never holds more than the unit the cap lets through while one is leased.
        assert buffered["buffered_bytes"] <= buffered["unit_bytes"], buffered
        seen.append(index)

    result = feeder.join()
    assert sorted(seen) == list(range(6)), seen  # every sample once, none lost
    assert result.outcome == "closed" and result.appended == 6 and result.acked_items == 3, result
    assert result.peak_in_flight <= 2
    doc = stack.wait(job_id)
    assert doc["state"] == "succeeded", (doc, stack.logs())
    assert doc["stream"]["items_acked"] == 3 and doc["stream"]["buffered_bytes"] == 0, doc["stream"]
    if backend == "shared_dir":
        assert not list((tmp_path / "features" / STORE_ID).glob("*.ckpt"))  # released by SpecForge's store
    stack.wait_deleted(job_id)  # by the workers
    assert not list(Path(doc["output_dir"]).glob("shard-*.safetensors"))  # acknowledged, so deleted
    assert (tmp_path / "control" / "refs.jsonl.closed").exists()


@postgres_only
def test_a_cancelled_job_reaches_the_trainer_as_a_producer_failure(
    stack: Stack, api: str, tmp_path: Path
) -> None:
    data = write_pretokenized(tmp_path / "d.jsonl", [24] * 6)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume", buffer_cap_bytes=1)["id"]
    stack.start_worker()
    feeder = FeederThread(api, job_id, tmp_path, window=2)
    loader, _ = specforge_loader(tmp_path)
    batches = iter(loader)
    first = next(batches)
    assert first.sample_ids == [f"{job_id}:00000000"]
    assert stack.client.post(f"/jobs/{job_id}/cancel").status_code == 200
    with pytest.raises(RuntimeError, match=f"producer failed: hsx job {job_id} cancelled"):
        for _ in batches:
            pass
    result = feeder.join()
    assert result.outcome == "failed" and "cancelled" in result.reason


@postgres_only
def test_a_failed_trainer_stops_the_feeder_and_its_shards_go_back(
    stack: Stack, api: str, tmp_path: Path
) -> None:
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

    data = write_pretokenized(tmp_path / "d.jsonl", [20] * 4)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume", buffer_cap_bytes=1)["id"]
    stack.start_worker()
    feeder = FeederThread(api, job_id, tmp_path, window=2)
    loader, channel = specforge_loader(tmp_path)
    first = next(iter(loader))  # read, never acknowledged: the trainer dies before its optimizer step
    assert first.sample_ids == [f"{job_id}:00000000"]
    StreamingRefChannel(channel.path).mark_consumer_failed("RuntimeError: CUDA out of memory")
    result = feeder.join()
    assert result.outcome == "trainer_failed" and "CUDA out of memory" in result.reason, result
    doc = stack.job(job_id)
    assert doc["stream"]["consumers"] == [] and doc["stream"]["items_acked"] == 0, doc["stream"]
    # Nothing unacknowledged is deleted: the first shard is still there for the next trainer.
    assert (Path(doc["output_dir"]) / "shard-00000.safetensors").exists()


def feed_command(api: str, job_id: str, tmp: Path, verb: str = "feed") -> list[str]:
    return [
        *[sys.executable, "-m", "hsx.cli", verb, "specforge", job_id],
        *["--channel", str(tmp / "control" / "refs.jsonl"), "--store-root", str(tmp / "features")],
        *["--store-id", STORE_ID, "--window", "2", "--api-url", api, "--poll-seconds", "0.1"],
    ]


@postgres_only
def test_a_feeder_killed_mid_append_is_restarted_with_nothing_lost_or_twice(
    stack: Stack, api: str, tmp_path: Path
) -> None:
    data = write_pretokenized(tmp_path / "d.jsonl", [20] * 6)
    job_id = stack.submit(data, samples_per_shard=2, retention="consume", buffer_cap_bytes=1)["id"]
    stack.start_worker()
    refs_file = tmp_path / "control" / "refs.jsonl"
    first = subprocess.Popen(feed_command(api, job_id, tmp_path), cwd=REPO)
    deadline = time.monotonic() + 240
    while not refs_file.exists() or len(records(refs_file)) < 2:
        assert first.poll() is None and time.monotonic() < deadline, stack.logs()
        time.sleep(0.2)
    first.kill()  # SIGKILL, holding its shard leased for an hour
    first.wait()
    with refs_file.open("a") as fh:  # and as if it died halfway through appending the next ref
        fh.write('{"sample_id":"' + job_id + ":000000")
    second = subprocess.Popen(  # under the command's first name, which still works
        feed_command(api, job_id, tmp_path, verb="publish"), cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    loader, _ = specforge_loader(tmp_path)
    seen = [int(batch.sample_ids[0].rsplit(":", 1)[1]) for batch in loader]
    out, _ = second.communicate(timeout=120)
    assert seen == list(range(6)), seen  # the first shard's refs are not appended again, none lost
    assert second.returncode == 0 and "closed; 4 refs appended, 3 shards acknowledged" in out, out
    refs = records(refs_file)
    assert [r["sample_id"] for r in refs] == [f"{job_id}:{i:08d}" for i in range(6)]
    doc = stack.wait(job_id)
    assert doc["state"] == "succeeded" and doc["stream"]["items_acked"] == 3, doc


def test_our_channel_and_files_are_what_specforge_reads_and_we_read_its_sidecars(tmp_path: Path) -> None:
    """No stack: hsx's writer of the layout against SpecForge's own channel and store, both directions."""
    from specforge.runtime.contracts import SampleRef
    from specforge.runtime.data_plane.disaggregated import SharedDirFeatureStore
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

    from hsx.integrations.specforge import feed_layout as layout

    ours = layout.RefChannel(tmp_path / "refs.jsonl")
    features = layout.FeatureDir(tmp_path / "features", STORE_ID)
    tensors = {
        "input_ids": torch.arange(5).unsqueeze(0),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1]]),
        "attention_mask": torch.ones(1, 5, dtype=torch.int64),
        "hidden_state": torch.randn(1, 5, 12).to(torch.bfloat16),
        "target": torch.randn(1, 5, 4).to(torch.bfloat16),
    }
    features.write("job:00000000", tensors)
    ours.append([layout.sample_ref("job:00000000", features, tensors, "job", {"hsx_job": "job"})])

    theirs = StreamingRefChannel(str(tmp_path / "refs.jsonl"))
    (ref,) = theirs.poll()
    assert isinstance(ref, SampleRef) and ref.feature_specs["target"].target_repr == "hidden_state"
    assert ref.feature_specs["hidden_state"].shape == (1, 5, 12) and ref.num_tokens == 5
    store = SharedDirFeatureStore(str(tmp_path / "features"), store_id=STORE_ID)
    got, handle = store.get(ref)
    assert all(torch.equal(got[name], tensors[name]) for name in tensors)
    store.release(handle)
    assert not features.exists("job:00000000")  # a non-retaining store frees the file: we see it gone

    # The trainer's sidecars, written by SpecForge, read by us; ours read by SpecForge.
    assert (ours.consumed(), ours.quantum(), ours.consumer_stopped()) == (0, 0, None)
    theirs.mark_consumed(1)
    theirs.publish_consumer_quantum(8)
    assert (ours.consumed(), ours.quantum()) == (1, 8)
    theirs.mark_consumer_failed("OOM at step 3")
    assert ours.consumer_stopped() == "trainer failed: OOM at step 3"
    assert theirs.failure() is None and not theirs.is_closed()
    ours.fail("hsx job j cancelled: by request")
    ours.close()
    assert theirs.failure() == "hsx job j cancelled: by request" and theirs.is_closed()

    # A torn last line (a crash mid-append) is cut when the channel is opened again, and only then.
    with (tmp_path / "refs.jsonl").open("a") as fh:
        fh.write('{"sample_id": "job:0000')
    assert layout.RefChannel(tmp_path / "refs.jsonl").appended == 1
    assert (tmp_path / "refs.jsonl").read_text().endswith("}\n")
