"""``hsx bench scale``: a 100,000-sample job (synthetic engine, small states) with 16 worker processes, on
SQLite or PostgreSQL (``--database-url``).

    hsx bench scale [--samples 100000] [--processes 16] [--database-url postgresql+psycopg://...]

Shows: how long ``POST /jobs`` takes and how soon the job is running; the most leases held at once; unit
throughput per tenth of the job, first to last (flat when a unit's cost does not grow with its place in
the dataset), and the read of the first and of the last unit's records timed directly; and, read back
through the loader, that no sample is lost or written twice. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import private_stack, say, table, write_pretokenized  # noqa: E402


def read_cost(records_path: str, units: list[tuple[int, int, int, int]], repeat: int = 50) -> float:
    """Mean seconds to read one unit's records through hsx.server.ingest.read_unit."""
    from hsx.server.ingest import UnitRange, read_unit

    started = time.perf_counter()
    for _ in range(repeat):
        for s0, s1, b0, b1 in units:
            for _record in read_unit(records_path, None, UnitRange(s0, s1, b0, b1)):
                pass
    return (time.perf_counter() - started) / (repeat * len(units))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsx bench scale", description=__doc__)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--database-url")
    args = parser.parse_args(argv)
    from sqlalchemy import select

    from hsx.loader import OutputReader
    from hsx.server.db.models import Job, WorkUnit
    from hsx.server.db.session import session_scope
    from hsx.server.jobs import queries

    settings = {"HSX_ENGINE_CONCURRENCY": "4", "HSX_RECONCILE_SECONDS": "5"}
    with private_stack("scale", database_url=args.database_url, settings=settings) as stack:
        db = stack.env["HSX_DATABASE_URL"]
        dataset = stack.work / "scale.jsonl"
        write_pretokenized(dataset, [args.tokens] * args.samples)
        stack.start_engine_synthetic(16, 8)
        stack.start_api()
        started = time.perf_counter()
        stack.start_workers(args.processes, timeout=600)  # 16 imports on a small host take a while
        say(f"{args.processes} worker processes ready after {time.perf_counter() - started:.0f}s")
        job_id, submit_s = stack.submit(dataset, samples_per_shard=args.samples_per_shard)
        submitted = time.perf_counter()
        while stack.job(job_id)["state"] == "queued":
            time.sleep(0.1)
        to_running = time.perf_counter() - submitted
        say(f"POST /jobs {submit_s * 1000:.0f} ms; running after {to_running:.1f}s")
        peak = {"leases": 0}
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                with session_scope(db) as session:
                    peak["leases"] = max(
                        peak["leases"], queries.live_lease_count(session, job_id, time.time())
                    )
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        doc = stack.wait(job_id, timeout=3600)
        done.set()
        watcher.join()
        if doc["state"] != "succeeded":
            raise SystemExit(f"job {doc['state']}: {doc.get('error')}")
        with session_scope(db) as session:
            rows = session.execute(
                select(
                    WorkUnit.unit_index,
                    WorkUnit.finished_at,
                    WorkUnit.sample_start,
                    WorkUnit.sample_end,
                    WorkUnit.byte_start,
                    WorkUnit.byte_end,
                )  # fmt: skip
                .where(WorkUnit.job_id == job_id)
                .order_by(WorkUnit.unit_index)
            ).all()
            records_path = session.scalar(select(Job.records_path).where(Job.id == job_id))
        stamps = sorted(row[1].timestamp() for row in rows)
        tenth = max(1, len(stamps) // 10)
        rates = []
        for d in range(10):
            part = stamps[d * tenth : (d + 1) * tenth] if d < 9 else stamps[9 * tenth :]
            if len(part) > 1:
                rates.append(round((len(part) - 1) / max(part[-1] - part[0], 1e-6), 1))
        spans = [(r[2], r[3], r[4], r[5]) for r in rows]
        first_read = read_cost(str(records_path), spans[:1])
        last_read = read_cost(str(records_path), spans[-1:])
        reader = OutputReader(doc["output_dir"])
        seen = [sample.index for sample in reader]
        result = {
            "bench": "scale",
            "database": "postgresql" if "postgres" in db else "sqlite",
            "samples": args.samples,
            "units": len(rows),
            "processes": args.processes,
            "submit_ms": round(submit_s * 1000, 1),
            "to_running_s": round(to_running, 2),
            "max_live_leases": peak["leases"],
            "units_per_s_by_tenth": rates,
            "ratio_last_vs_first_tenth": round(rates[-1] / rates[0], 3) if rates else None,
            "first_unit_read_ms": round(first_read * 1000, 3),
            "last_unit_read_ms": round(last_read * 1000, 3),
            "ratio_last_vs_first_read": round(last_read / first_read, 3),
            "read_back": len(seen),
            "lost": args.samples - len(set(seen)),
            "duplicated": len(seen) - len(set(seen)),
            "job_tok_s": doc["progress"]["tokens_per_second"],
        }
    table([(key, str(value)) for key, value in result.items()])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
