"""``hsx bench memory``: peak RSS of one worker process over a job at H=7168 with 8,192-token samples and
64-sample units, against the same worker's idle RSS; then the same job cut into 8-sample units, to show
that the peak does not grow with unit size.

    hsx bench memory [--samples 12] [--tokens 8192] [--hidden-size 7168] [--num-layers 61]

The worker is one ``hsx worker`` process; the work horse it forks for the job is part of it (the largest
RSS of the two at any moment counts). Sampled every 20 ms. Prints a table, then one JSON line:
``idle_rss_mib``, ``peak_rss_mib``, ``delta_mib`` (for 64-sample units), and the same for 8-sample units.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import private_stack, say, table, write_pretokenized  # noqa: E402

MIB = 1 << 20


class RssSampler(threading.Thread):
    """The largest RSS of a process or any of its descendants, sampled until stopped."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.stopped = threading.Event()

    def current(self) -> int:
        biggest = 0
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                biggest = max(biggest, proc.memory_info().rss)
            except psutil.Error:
                continue
        return biggest

    def run(self) -> None:
        while not self.stopped.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(self.interval)


def one_run(args: argparse.Namespace, samples_per_shard: int) -> dict[str, float]:
    with private_stack(f"memory-{samples_per_shard}", settings={"HSX_ENGINE_CONCURRENCY": "4"}) as stack:
        dataset = stack.work / "long.jsonl"
        write_pretokenized(dataset, [args.tokens] * args.samples)
        stack.start_engine_synthetic(args.hidden_size, args.num_layers)
        stack.start_api()
        worker = stack.local.start("worker", [sys.executable, "-m", "hsx.cli", "worker"], stack.env)
        time.sleep(8)  # imports done: the worker is idle
        sampler = RssSampler(worker.pid)
        idle = sampler.current()
        sampler.start()
        job_id, _ = stack.submit(dataset, samples_per_shard=samples_per_shard)
        doc = stack.wait(job_id, timeout=1800)
        sampler.stopped.set()
        sampler.join()
        if doc["state"] != "succeeded":
            raise SystemExit(f"job {doc['state']}: {doc.get('error')}")
        say(f"units of {samples_per_shard}: idle {idle / MIB:.0f} MiB, peak {sampler.peak / MIB:.0f} MiB")
        return {
            "idle_rss_mib": round(idle / MIB, 1),
            "peak_rss_mib": round(sampler.peak / MIB, 1),
            "delta_mib": round((sampler.peak - idle) / MIB, 1),
            "state_gib": round(doc["progress"]["tokens"] * args.hidden_size * 2 * 4 / (1 << 30), 2),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsx bench memory", description=__doc__)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--num-layers", type=int, default=61)
    args = parser.parse_args(argv)
    big = one_run(args, 64)
    small = one_run(args, 8)
    result = {
        "bench": "memory",
        "hidden_size": args.hidden_size,
        "tokens_per_sample": args.tokens,
        "samples": args.samples,
        **big,
        "units_of_8": small,
        "ratio_peak_64_vs_8": round(big["delta_mib"] / max(small["delta_mib"], 1.0), 3),
    }
    table([(key, str(value)) for key, value in result.items()])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
