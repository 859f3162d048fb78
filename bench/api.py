"""``hsx bench api``: ``GET /jobs/{id}`` latency at a fixed request rate, sent from a second process, while a
job runs; the same load on the same API with no job running is the baseline.

    hsx bench api [--rate 200] [--seconds 20]

The load is open-loop: request ``i`` is sent at ``start + i / rate`` whatever earlier ones took (a slow
answer cannot hide later ones), from one asyncio loop. Prints a table, then one JSON line: ``rate``,
``p50_ms``, ``p99_ms``, ``errors`` while the job runs, and ``idle_p50_ms``, ``idle_p99_ms`` without it;
``late_p99_ms`` says whether the load generator kept to its schedule.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import private_stack, say, table, write_pretokenized  # noqa: E402


def load(url: str, rate: float, seconds: float) -> dict[str, float]:
    """Runs in the second process: send the requests, report latency percentiles and errors.

    One asyncio loop over raw keep-alive HTTP/1.1 connections: a full client library costs a few ms of CPU
    a request, so at 200/s on two cores the generator itself fell behind and its own delays were measured.
    Latency runs from the moment a request is written to the end of its body; ``late_p99_ms`` says how far
    behind schedule requests were sent (near 0 when the generator kept up)."""
    import asyncio
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = f"GET {parts.path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: */*\r\n\r\n".encode()
    total = int(rate * seconds)

    async def fetch(idle: asyncio.LifoQueue[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> bool:
        try:
            reader, writer = idle.get_nowait()
            reused = True
        except asyncio.QueueEmpty:
            reader, writer = await asyncio.open_connection(host, port)
            reused = False
        writer.write(request)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if not reused or getattr(exc, "partial", b""):
                raise
            # The server closed this idle keep-alive connection (as every client library does: once more,
            # on a new connection; the time it took is part of the latency).
            writer.close()
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        await reader.readexactly(length)
        idle.put_nowait((reader, writer))
        return status == 200

    async def run() -> tuple[list[float], list[float], int, float]:
        idle: asyncio.LifoQueue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.LifoQueue()
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.2

        async def one(i: int) -> tuple[float | None, float]:
            due = start + i / rate
            await asyncio.sleep(max(0.0, due - loop.time()))
            sent = loop.time()
            try:
                ok = await asyncio.wait_for(fetch(idle), 10)
            except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                ok = False
            return (loop.time() - sent if ok else None), sent - due

        results = await asyncio.gather(*(one(i) for i in range(total)))
        elapsed = loop.time() - start
        while not idle.empty():
            idle.get_nowait()[1].close()
        latencies = sorted(r for r, _ in results if r is not None)
        lateness = sorted(late for _, late in results)
        return latencies, lateness, sum(1 for r, _ in results if r is None), elapsed

    latencies, lateness, errors, elapsed = asyncio.run(run())

    def pct(values: list[float], p: float) -> float:
        return round(1000 * values[min(len(values) - 1, int(p * len(values)))], 2) if values else -1

    return {"requests": total, "achieved_rate": round(total / elapsed, 1), "p50_ms": pct(latencies, 0.5),
            "p99_ms": pct(latencies, 0.99), "errors": errors, "late_p99_ms": pct(lateness, 0.99)}  # fmt: skip


def second_process(url: str, rate: float, seconds: float) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--load", url, "--rate", str(rate), "--seconds", str(seconds)],
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsx bench api", description=__doc__)
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--database-url")
    parser.add_argument(
        "--worker-nice",
        type=int,
        default=10,
        help="HSX_WORKER_NICE for the job's workers and engine: on a shared host the API comes first",
    )
    args = parser.parse_args(argv)
    if args.load:
        print(json.dumps(load(args.load, args.rate, args.seconds)))
        return 0
    nice = {"HSX_WORKER_NICE": str(args.worker_nice)}
    with private_stack("api", database_url=args.database_url, settings=nice) as stack:
        dataset = stack.work / "many.jsonl"
        write_pretokenized(dataset, [512] * 4000)
        stack.start_engine_synthetic(1024, 32)
        stack.start_api()
        # A finished job to poll first: the baseline, with nothing else running.
        small = stack.work / "small.jsonl"
        write_pretokenized(small, [64] * 64)
        stack.start_workers(1)
        done_id, _ = stack.submit(small, samples_per_shard=8)
        stack.wait(done_id, timeout=300)
        idle = second_process(f"{stack.api_url}/jobs/{done_id}", args.rate, args.seconds)
        say(f"idle: {idle}")
        job_id, _ = stack.submit(dataset, samples_per_shard=32)
        while stack.job(job_id)["state"] != "running":
            time.sleep(0.2)
        busy = second_process(f"{stack.api_url}/jobs/{job_id}", args.rate, args.seconds)
        doc = stack.job(job_id)
        if doc["state"] != "running":
            say(f"warning: the job was {doc['state']} before the load ended")
    result = {
        "bench": "api",
        "rate": args.rate,
        "worker_nice": args.worker_nice,
        **busy,
        "job_state_after": doc["state"],
        "job_units_done": doc["progress"]["units_done"],
        "idle_p50_ms": idle["p50_ms"],
        "idle_p99_ms": idle["p99_ms"],
        "idle_late_p99_ms": idle["late_p99_ms"],
        "ratio_p99_busy_vs_idle": round(busy["p99_ms"] / max(idle["p99_ms"], 1e-3), 2),
    }
    table([(key, str(value)) for key, value in result.items()])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
