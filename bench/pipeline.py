"""``hsx bench pipeline``: a whole job (API, queue, workers, synthetic engine) against its two limits,
measured in the same run: the synthetic engine driven directly at the same concurrency, and an fsynced
copy of as many bytes from the dump directory to the output directory as the job moves (what a worker
must move at least; the dumps of ``--baseline-samples`` prompts, copied over and over to reach the volume).

    hsx bench pipeline [--samples 160] [--tokens 1024] [--hidden-size 4096] [--num-layers 32]
                       [--processes 2] [--concurrency 4] [--database-url URL]

Each baseline is measured before and after the job and averaged (the disk here is noisy). The job's rate
is its own: tokens over its started_at..finished_at. Prints a table, then one JSON line:
``job_tok_s``, ``engine_tok_s``, ``copy_tok_s``, ``ratio`` (job / the smaller baseline).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    drive_engine,
    fsynced_copy_rate,
    job_rate,
    job_timeline,
    make_dumps,
    mean,
    private_stack,
    read_prompts,
    say,
    table,
    write_pretokenized,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsx bench pipeline", description=__doc__)
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--processes", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=4, help="prefills in flight per worker process")
    parser.add_argument("--samples-per-shard", type=int, default=16)
    parser.add_argument("--baseline-samples", type=int, default=32)
    parser.add_argument("--database-url")
    args = parser.parse_args(argv)
    in_flight = args.processes * args.concurrency
    settings = {"HSX_ENGINE_CONCURRENCY": str(args.concurrency), "HSX_LOG_FORMAT": "json"}
    with private_stack("pipeline", database_url=args.database_url, settings=settings) as stack:
        dataset = stack.work / "bench.jsonl"
        total = write_pretokenized(dataset, [args.tokens] * args.samples)
        stack.start_engine_synthetic(args.hidden_size, args.num_layers)
        stack.start_api()
        stack.start_workers(args.processes)
        prompts = read_prompts(dataset, args.baseline_samples)
        dump_dir = stack.env["HSX_DUMP_DIR"]
        out = Path(stack.env["HSX_OUTPUT_DIR"])

        def baselines() -> tuple[float, float]:
            engine = drive_engine(stack.engine_url, prompts, in_flight, dump_dir, captured=True)
            dumps = make_dumps(stack.engine_url, dump_dir, prompts[: max(4, len(prompts) // 2)])
            size = sum(p.stat().st_size for p in dumps)
            tokens = len(dumps) * args.tokens
            rounds = -(-args.samples // len(dumps))  # the job's volume
            rate = fsynced_copy_rate(dumps, out.parent / "copy-baseline", args.processes, rounds)
            copy = rate * tokens / size
            for path in dumps:
                for item in path.parent.iterdir():
                    item.unlink()
                path.parent.rmdir()
            return engine, copy

        drive_engine(stack.engine_url, prompts[:4], 4, dump_dir, captured=True)  # warm-up
        engine_before, copy_before = baselines()
        say(f"before: engine {engine_before:,.0f} tok/s, copy {copy_before:,.0f} tok/s; running the job")
        job_id, submit_s = stack.submit(dataset, samples_per_shard=args.samples_per_shard)
        doc = stack.wait(job_id, timeout=3600)
        if doc["state"] != "succeeded":
            raise SystemExit(f"job {doc['state']}: {doc.get('error')}")
        job = job_rate(doc)
        engine_after, copy_after = baselines()
        engine, copy = mean([engine_before, engine_after]), mean([copy_before, copy_after])
        result = {
            "bench": "pipeline",
            "samples": args.samples,
            "tokens": total,
            "hidden_size": args.hidden_size,
            "processes": args.processes,
            "in_flight": in_flight,
            "submit_s": round(submit_s, 3),
            "job_tok_s": round(job),
            "engine_tok_s": round(engine),
            "copy_tok_s": round(copy),
            "engine_tok_s_before_after": [round(engine_before), round(engine_after)],
            "copy_tok_s_before_after": [round(copy_before), round(copy_after)],
            "samples_done": doc["progress"]["samples_done"],
            "ratio": round(job / min(engine, copy), 3),
            "timeline": job_timeline(stack.local.log_dir / "workers.log", doc),
        }
    table([(key, str(value)) for key, value in result.items()])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
