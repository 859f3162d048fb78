"""streamed.sh's Python side (the drafter proof's "hsx, streamed" row; docs/drafter.md).

    python3 streamed.py expect DATASET ENGINE_URL MAX_LENGTH SAMPLES_PER_SHARD   # bytes the job will write
    python3 streamed.py monitor STATE_DIR                                        # peaks, until the end
    python3 streamed.py status STATE_DIR                                         # one JSON line

``expect`` projects the job's output as the job's own prepare step does (``workers/output_size.py`` over
every record, with the engine's tokenizer and chat template), so the byte cap is a true fraction of what
the job writes. ``monitor`` samples the job every half second and keeps the peaks of what it holds on
disk: ``stored_bytes`` as hsx counts it, and the bytes of the files under the job's output directory as
the disk counts them. ``status`` reads the job, those peaks, the trainer's log (its tqdm bar and the
metrics SpecForge's controller logs every ``log_interval`` steps) and the exit files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

FINAL = {"succeeded", "failed", "cancelled"}
# SpecForge 0.2.0's assembly._logger prints "step N: {metrics}" every log_interval optimizer steps; its
# controller's metrics hold perf/data_wait_time_s, the mean wait for the next batch per step of the window.
METRICS_LINE = re.compile(r"^step (\d+): \{")
DATA_WAIT = re.compile(r"'perf/data_wait_time_s': ([-+0-9.eE]+|nan|inf)")


def expect(dataset: str, engine_url: str, max_length: int, samples_per_shard: int) -> int:
    from hsx.engine.client import EngineClient
    from hsx.server.ingest.records import plan_units
    from workers.chat import ChatEncoder
    from workers.job_tokenizer import load_tokenizer
    from workers.output_size import OutputProjector

    with EngineClient(engine_url) as client:
        info = client.info()
    tokenizer = load_tokenizer(os.environ.get("HSX_TOKENIZER_PATH") or info.model_path)
    projector = OutputProjector(
        info, max_length, "truncate", lambda: ChatEncoder(tokenizer, True, None), sample_size=1 << 30
    )
    prepared = plan_units(dataset, samples_per_shard, projector.observe)
    return projector.finish(len(prepared.units)).bytes


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _job(state: Path) -> dict[str, Any] | None:
    api, job = _read(state / "api_url"), _read(state / "job_id")
    if not api or not job:
        return None
    try:
        doc: dict[str, Any] = httpx.get(f"{api}/jobs/{job}", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    return doc


def _disk_bytes(output_dir: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(output_dir):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def monitor(state: Path) -> None:
    peaks = {"stored_bytes": 0, "stored_and_in_flight_bytes": 0, "disk_bytes": 0}
    trainer_exit = Path(_read(state / "train_dir") or state) / "exit"
    while True:
        doc = _job(state)
        if doc is not None:  # status falls back to it once the API is stopped
            (state / "job.last.json.tmp").write_text(json.dumps(doc))
            (state / "job.last.json.tmp").replace(state / "job.last.json")
        if doc is not None and doc.get("stream"):
            stream = doc["stream"]
            seen = {
                "stored_bytes": int(stream["stored_bytes"]),
                "stored_and_in_flight_bytes": int(stream["stored_bytes"]) + int(stream["in_flight_bytes"]),
                "disk_bytes": _disk_bytes(str(doc["output_dir"])),
            }
            if any(value > peaks[key] for key, value in seen.items()):
                peaks = {**peaks, **{k: max(v, peaks[k]) for k, v in seen.items()}}
                tmp = state / "peak.json.tmp"
                tmp.write_text(json.dumps(peaks))
                tmp.replace(state / "peak.json")
        if doc is not None and doc["state"] in FINAL and trainer_exit.exists():
            return
        time.sleep(0.5)


def durable_step(control: Path) -> int | None:
    """The optimizer step the consumer's own ledger has made durable (its SQLite ``marker`` table, the
    step its acknowledgements are committed at), read-only."""
    import sqlite3

    path = control / "consumer.sqlite"
    if not path.exists():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            row = db.execute("SELECT v FROM marker WHERE k = 'global_step'").fetchone()
    except sqlite3.Error:
        return None
    return int(row[0]) if row else 0


def trainer_progress(log: Path) -> dict[str, Any]:
    """The trainer's last logged step and how long it waited for data, as far as its log says."""
    step, waited, logged = 0, 0.0, 0
    interval = None
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {"step": 0}
    last_logged = 0
    for line in re.split(r"[\r\n]", text):
        match = METRICS_LINE.match(line)
        if match:
            at = int(match.group(1))
            wait = DATA_WAIT.search(line)
            window = at - last_logged  # every step since the last log line; the mean is per step of these
            last_logged, logged, interval = at, at, window
            step = max(step, at)
            waited += float(wait.group(1)) * window if wait else 0.0
    return {
        "step": step,
        "data_wait_s": round(waited, 3),
        "data_wait_through_step": logged,
        "log_interval": interval,
    }


def _alive(state: Path, name: str) -> bool | None:
    pid = _read(state / f"{name}.pid")
    if not pid:
        return None
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True


def status(state: Path) -> dict[str, Any]:
    doc = _job(state)
    last = _read(state / "job.last.json")
    if doc is None and last:
        doc = json.loads(last)  # the API is gone (stopped): the monitor's last reading
    out: dict[str, Any] = {"job": _read(state / "job_id")}
    if doc is not None:
        progress, stream = doc["progress"], doc.get("stream") or {}
        out.update(
            state=doc["state"],
            samples_done=progress["samples_done"],
            samples_rejected=progress["samples_rejected"],
            samples_total=progress["samples_total"],
            stored_bytes=stream.get("stored_bytes"),
            cap_bytes=stream.get("cap_bytes"),
            projected_bytes=(doc.get("output") or {}).get("projected_bytes"),
            bytes_written=(doc.get("output") or {}).get("bytes_written"),
            waiting_on_consumers=stream.get("waiting_on_consumers"),
        )
    peaks = _read(state / "peak.json")
    out["peak"] = json.loads(peaks) if peaks else None
    train_dir = Path(_read(state / "train_dir") or state)
    trainer = trainer_progress(Path(_read(state / "train_log") or train_dir / "train.log"))
    durable = durable_step(state / "control")
    trainer["step"] = max(trainer["step"], durable or 0)
    schedule = _read(state / "control" / "refs.jsonl.schedule.json")
    trainer["total_steps"] = json.loads(schedule)["total_steps"] if schedule else None
    out["trainer"] = trainer
    out["trainer_exit"] = int(_read(train_dir / "exit") or -1) if (train_dir / "exit").exists() else None
    out["feeder_exit"] = int(_read(state / "feeder.exit") or -1) if (state / "feeder.exit").exists() else None
    out["alive"] = {name: _alive(state, name) for name in ("trainer", "feeder", "worker", "api")}
    out["done"] = out["trainer_exit"] is not None
    return out


def main(argv: list[str]) -> int:
    command, args = argv[1], argv[2:]
    if command == "expect":
        print(expect(args[0], args[1], int(args[2]), int(args[3])))
    elif command == "monitor":
        monitor(Path(args[0]))
    elif command == "status":
        print(json.dumps(status(Path(args[0])), sort_keys=True))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
