"""``hsx bench long --engine-url URL``: jobs of long samples (32,768, 65,536 and 131,072 tokens by default)
against a running engine (the patched SGLang on a GPU host), each length against plain prefill of the
same prompts at the same concurrency, in keep and in consume mode, in the same run.

    hsx bench long --engine-url http://127.0.0.1:30000 [--lengths 32768,65536,131072] [--samples 4,2,1]
                   [--processes 4] [--concurrency 1] [--consumers 8] [--cap-fraction 1.0]
                   [--modes keep,consume] [--output-dir DIR]

Each sample is a unit of its own (``samples_per_shard`` 1), so the worker processes take the samples of a
length side by side. For each job: the rows are checked exact (every shard's sample holds exactly the
prompt's tokens, no sample rejected), the worker processes' peak RSS is sampled every 20 ms (the largest
of any process of the tree, against its idle RSS before the job) and the API's, and the job's timeline is
read from the workers' log (bench/harness.py). The consume job is drained by ``--consumers`` readers that
check every shard's sha256 (bench/stream.py). Prints a table, then one JSON line per length.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    Stack,
    drive_engine,
    job_rate,
    job_timeline,
    private_stack,
    read_prompts,
    say,
    write_pretokenized,
)
from memory import RssSampler  # noqa: E402
from stream import ConsumerTimeline, consume  # noqa: E402

from hsx.engine.client import EngineClient  # noqa: E402

MIB = 1 << 20


def rows_exact(doc: dict[str, Any], length: int, samples: int) -> bool:
    """Every sample of the job's shards holds ``length`` tokens, and all ``samples`` are there (read from
    the shards' headers and token tensors, not their states)."""
    from hsx.loader import OutputReader

    if doc["progress"]["samples_done"] != samples or doc["progress"]["samples_rejected"]:
        return False
    reader = OutputReader(doc["output_dir"])
    seen = 0
    for number in range(len(reader.shard_sample_counts())):
        view = reader.shard(number)
        lengths = [int(b - a) for a, b in zip(view.offsets[:-1], view.offsets[1:], strict=True)]
        seen += len(lengths)
        if any(n != length for n in lengths):
            return False
    return seen == samples


def one_job(
    stack: Stack,
    dataset: Path,
    length: int,
    samples: int,
    args: argparse.Namespace,
    workers_pid: int,
    api_pid: int,
    mode: str,
    cap: int | None,
) -> dict[str, Any]:
    sampler, api = RssSampler(workers_pid), RssSampler(api_pid)
    idle = sampler.current()
    sampler.start()
    api.start()
    options: dict[str, Any] = {"samples_per_shard": 1, "max_length": length}
    if mode == "consume":
        options.update(retention="consume", buffer_cap_bytes=cap)
    job_id, _ = stack.submit(dataset, **options)
    readers = ConsumerTimeline()
    seen: list[int] = []
    if mode == "consume":
        consume(stack, job_id, seen, args.consumers, readers)
    doc = stack.wait(job_id, timeout=3600)
    for s in (sampler, api):
        s.stopped.set()
        s.join()
    if doc["state"] != "succeeded":
        raise SystemExit(f"{mode} job of {length}-token samples {doc['state']}: {doc.get('error')}")
    timeline = job_timeline(stack.local.log_dir / "workers.log", doc, args.processes)
    row: dict[str, Any] = {
        "tok_s": round(job_rate(doc)),
        "rows_exact": rows_exact(doc, length, samples) if mode == "keep" else len(set(seen)) == samples,
        "worker_peak_rss_mib": round(sampler.peak / MIB),
        "worker_rss_growth_mib": round((sampler.peak - idle) / MIB),
        "api_peak_rss_mib": round(api.peak / MIB),
        "bytes": int(doc["output"]["bytes_written"]),
        "timeline": {k: v for k, v in timeline.items() if k.startswith("worker_") or k == "seconds"},
    }
    if mode == "consume":
        row["consumers"] = readers.shares(args.consumers * timeline["seconds"])
        row["lost"] = samples - len(set(seen))
        row["duplicated"] = len(seen) - len(set(seen))
    shutil.rmtree(doc["output_dir"], ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsx bench long", description=__doc__)
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--lengths", default="32768,65536,131072")
    parser.add_argument("--samples", default="4,2,1", help="samples of each length")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1, help="prefills in flight per worker process")
    parser.add_argument("--consumers", type=int, default=8)
    parser.add_argument("--cap-fraction", type=float, default=1.0, help="the consume cap, of the output")
    parser.add_argument("--modes", default="keep,consume")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--output-dir", type=Path, help="where the jobs write (default: the work directory)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    counts = [int(x) for x in args.samples.split(",")]
    if len(counts) != len(lengths):
        parser.error("--samples needs one count per length")
    modes = args.modes.split(",")
    info = EngineClient(args.engine_url).info()
    settings = {
        "HSX_ENGINE_CONCURRENCY": str(args.concurrency),
        "HSX_ENGINE_URL": args.engine_url,
        "HSX_DUMP_DIR": info.dump_dir,
        "HSX_LOG_FORMAT": "json",
        "HSX_JOB_DOCUMENT_TTL_SECONDS": "0.2",
        "HSX_DUMP_WAIT_SECONDS": "600",  # a 131,072-token dump at H=7168 is 7.5 GB, written after the answer
    }
    tensors = len(info.hf_indices) + (1 if info.final_state == "both" else 0)
    bytes_per_token = 4 + tensors * info.hidden_size * 2
    rows = []
    with private_stack("long", output_dir=args.output_dir, settings=settings) as stack:
        stack.env.update(settings)
        stack.engine_url = args.engine_url
        stack.start_api()
        api_pid = stack.local.procs[-1][1].pid
        workers = stack.start_workers(args.processes)
        time.sleep(2)  # the work horses' parents are idle: their RSS is the baseline
        for length, samples in zip(lengths, counts, strict=True):
            dataset = stack.work / f"long-{length}.jsonl"
            write_pretokenized(dataset, [length] * samples, vocab=args.vocab)
            prompts = read_prompts(dataset)
            in_flight = min(samples, args.processes * args.concurrency)
            say(f"{length} tokens x {samples}: plain prefill at {in_flight} in flight")
            plain = drive_engine(args.engine_url, prompts, in_flight, None, captured=False)
            row: dict[str, Any] = {
                "length": length,
                "samples": samples,
                "in_flight": in_flight,
                "state_bytes_per_sample": length * bytes_per_token,
                "plain_tok_s": round(plain),
            }
            cap = None
            for mode in modes:
                say(f"{length} tokens x {samples}: {mode} job")
                if mode == "consume":
                    # Of what the keep job wrote (shards hold ids, masks and a header beside the states).
                    estimate = samples * (length * bytes_per_token + 4096)
                    total = row["keep"]["bytes"] if "keep" in row else estimate
                    cap = max(1, int(total * args.cap_fraction))
                result = one_job(stack, dataset, length, samples, args, workers.pid, api_pid, mode, cap)
                result["vs_plain"] = round(result["tok_s"] / plain, 3)
                row[mode] = result
            # The bound tests/test_long_samples.py holds a worker to: its unit's ids and masks, plus 64 MiB.
            row["worker_rss_bound_mib"] = round((length * 77 + (64 << 20)) / MIB)
            rows.append(row)
            print(json.dumps({"bench": "long", "hidden_size": info.hidden_size, **row}), flush=True)
    print_table(rows, modes)
    return 0


def print_table(rows: list[dict[str, Any]], modes: list[str]) -> None:
    head = ["length", "samples", "plain tok/s"]
    for mode in modes:
        head += [f"{mode} tok/s", f"{mode}/plain", f"{mode} rows", f"{mode} worker RSS +MiB"]
    print(" | ".join(head))
    for row in rows:
        cells = [str(row["length"]), str(row["samples"]), f"{row['plain_tok_s']:,}"]
        for mode in modes:
            r = row[mode]
            cells += [f"{r['tok_s']:,}", str(r["vs_plain"]), "exact" if r["rows_exact"] else "WRONG"]
            cells += [f"{r['worker_rss_growth_mib']} (bound {row['worker_rss_bound_mib']})"]
        print(" | ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
