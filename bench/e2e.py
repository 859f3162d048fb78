"""``hsx bench e2e --engine-url URL``: a whole job against a running patched SGLang engine (on a GPU host)
vs the same engine's plain prefill of the same prompts at the same concurrency, and vs the raw fsynced
write rate of the output disk, measured in the same run.

    hsx bench e2e --engine-url http://127.0.0.1:30000 [--set uniform|mixed|both] [--processes 8]
                  [--concurrency 8] [--vocab 128256]

Sets: ``uniform`` is 256 prompts of 1,024 tokens; ``mixed`` is 128 prompts of 50 to 4,000 tokens. Prompts
are random token ids sent pre-tokenized (what the engine computes does not depend on their meaning).
Prints a table per set, then one JSON line: ``job_tok_s``, ``plain_tok_s``, ``disk_tok_s``, ``ratio`` (job /
the smaller baseline), per set.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    drive_engine,
    fsynced_write_rate,
    job_rate,
    job_timeline,
    mean,
    private_stack,
    read_prompts,
    say,
    table,
    write_pretokenized,
)

from hsx.engine.client import EngineClient  # noqa: E402


def lengths_for(name: str, samples: int, seed: int = 11) -> list[int]:
    """``samples`` prompts of 1,024 tokens, or half as many of 50 to 4,000 (about as many tokens)."""
    if name == "uniform":
        return [1024] * samples
    return np.random.default_rng(seed).integers(50, 4001, size=max(1, samples // 2)).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsx bench e2e", description=__doc__)
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--set", choices=["uniform", "mixed", "both"], default="both")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        default=None,
        help="default: 32, or fewer so that every worker process gets a unit",
    )
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="where the job writes its shards (default: the bench's work directory); /dev/shm takes the disk "
        "out of the measurement",
    )
    args = parser.parse_args(argv)
    info = EngineClient(args.engine_url).info()
    in_flight = args.processes * args.concurrency
    bytes_per_token = info.hidden_size * 2 * len(info.hf_indices) + 5
    settings = {
        "HSX_ENGINE_CONCURRENCY": str(args.concurrency),
        "HSX_ENGINE_URL": args.engine_url,
        "HSX_DUMP_DIR": info.dump_dir,
        "HSX_LOG_FORMAT": "json",  # the timeline below reads the workers' log
    }
    results = {}
    for name in ["uniform", "mixed"] if args.set == "both" else [args.set]:
        output_dir = args.output_dir / f"e2e-{name}" if args.output_dir else None
        with private_stack(f"e2e-{name}", output_dir=output_dir, settings=settings) as stack:
            stack.env.update(settings)
            stack.engine_url = args.engine_url
            dataset = stack.work / f"{name}.jsonl"
            lengths = lengths_for(name, args.samples)
            total = write_pretokenized(dataset, lengths, vocab=args.vocab)
            per_shard = args.samples_per_shard or max(1, min(32, len(lengths) // args.processes))
            prompts = read_prompts(dataset)
            out = Path(stack.env["HSX_OUTPUT_DIR"])
            stack.start_api()
            stack.start_workers(args.processes)
            drive_engine(args.engine_url, prompts[:16], in_flight, None, captured=False)  # warm-up

            def baselines(prompts: list[list[int]] = prompts, out: Path = out) -> tuple[float, float, float]:
                plain = drive_engine(args.engine_url, prompts, in_flight, None, captured=False)
                # Not a baseline of the ratio: the engine with the plugin dumping every prompt (each dump
                # deleted unread), which tells the plugin's cost from the workers'.
                captured = drive_engine(args.engine_url, prompts, in_flight, info.dump_dir, captured=True)
                disk = fsynced_write_rate(out.parent / "disk-baseline", 4 << 30, args.processes)
                return plain, captured, disk / bytes_per_token

            plain_before, captured_before, disk_before = baselines()
            say(f"{name}: plain {plain_before:,.0f} tok/s, disk {disk_before:,.0f} tok/s; running the job")
            job_id, _ = stack.submit(dataset, samples_per_shard=per_shard)
            doc = stack.wait(job_id, timeout=1800)
            if doc["state"] != "succeeded":
                raise SystemExit(f"job {doc['state']}: {doc.get('error')}")
            job = job_rate(doc)
            timeline = job_timeline(stack.local.log_dir / "workers.log", doc, args.processes)
            plain_after, captured_after, disk_after = baselines()
            plain, disk = mean([plain_before, plain_after]), mean([disk_before, disk_after])
            captured = mean([captured_before, captured_after])
            results[name] = {
                "samples": len(lengths),
                "tokens": total,
                "in_flight": in_flight,
                "processes": args.processes,
                "samples_per_shard": per_shard,
                "job_tok_s": round(job),
                "plain_tok_s": round(plain),
                "disk_tok_s": round(disk),
                "captured_tok_s": round(captured),
                "plain_before_after": [round(plain_before), round(plain_after)],
                "disk_before_after": [round(disk_before), round(disk_after)],
                "samples_done": doc["progress"]["samples_done"],
                "rejected": doc["progress"]["samples_rejected"],
                "ratio": round(job / min(plain, disk), 3),
                "ratio_vs_plain": round(job / plain, 3),
                "captured_vs_plain": round(captured / plain, 3),
                "timeline": timeline,
            }
            if output_dir is not None:
                shutil.rmtree(output_dir, ignore_errors=True)
            print(f"--- {name}")
            table([(key, str(value)) for key, value in results[name].items()])
    print(json.dumps({"bench": "e2e", "engine": info.backend, "hidden_size": info.hidden_size, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
