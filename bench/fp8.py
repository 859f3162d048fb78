"""``hsx bench fp8``: the same dataset as an engine-dtype (bf16) job and as an fp8 job, in one run against
one engine: bytes written, job tok/s, and their ratios; plus what the worker's fp8 encoding costs.

    hsx bench fp8 [--engine-url URL | --hidden-size 7168 --num-layers 16] [--samples 96] [--tokens 1024]
                  [--processes 2] [--concurrency 4] [--rounds 1] [--output-dir DIR]

Without ``--engine-url`` a synthetic engine (bf16 states) is started with the given shape. The jobs run in
ABBA order over ``--rounds`` (bf16, fp8, then fp8, bf16, ...) so that drift of a shared machine falls on
both alike. ``encode`` times the worker's quantization (``hsx.fp8.quantize_rows_torch``, one thread) of a
1 MiB bf16 chunk against copying it, on this host. Prints a table, then one JSON line: ``bytes_ratio`` (fp8
/ bf16 bytes written) and ``tok_s_ratio`` (fp8 job / bf16 job).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import job_rate, mean, private_stack, say, table, write_pretokenized  # noqa: E402


def encode_cost(hidden: int, repeats: int = 20) -> dict[str, float]:
    """MB/s of bf16 input through the worker's encoder and through a plain copy, one thread."""
    import torch

    from hsx import fp8

    torch.set_num_threads(1)
    rows = max(1, (1 << 20) // (2 * hidden))
    values = torch.randn(rows, hidden).to(torch.bfloat16)
    target = torch.empty_like(values)
    fp8.quantize_rows_torch(values)

    def rate(work: Any) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            work()
        return values.numel() * 2 * repeats / (time.perf_counter() - started) / 1e6

    encode = rate(lambda: fp8.quantize_rows_torch(values))
    copy = rate(lambda: target.copy_(values))
    numpy_words = values.view(torch.int16).numpy().view(np.uint16)
    numpy_encode = rate(lambda: fp8.quantize_rows(numpy_words, "BF16"))
    return {
        "encode_mb_s": round(encode),
        "copy_mb_s": round(copy),
        "numpy_encode_mb_s": round(numpy_encode),
        "encode_vs_numpy": round(encode / numpy_encode, 1),
    }


def _bytes_written(doc: dict[str, Any]) -> int:
    manifest = json.loads((Path(doc["output_dir"]) / "manifest.json").read_text())
    return sum(int(entry["bytes"]) for entry in manifest["shards"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsx bench fp8", description=__doc__)
    parser.add_argument("--engine-url", help="a running engine (default: start a synthetic one)")
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--processes", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=4, help="prefills in flight per worker process")
    parser.add_argument("--samples-per-shard", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="ABBA rounds of the two jobs")
    parser.add_argument("--output-dir", type=Path, help="where the jobs write (default: the work directory)")
    args = parser.parse_args(argv)
    settings = {"HSX_ENGINE_CONCURRENCY": str(args.concurrency), "HSX_LOG_FORMAT": "json"}
    runs: dict[str, list[dict[str, Any]]] = {"engine": [], "fp8_e4m3": []}
    with private_stack("fp8", output_dir=args.output_dir, settings=settings) as stack:
        if args.engine_url:
            hidden = stack.use_engine(args.engine_url)
        else:
            stack.start_engine_synthetic(args.hidden_size, args.num_layers)
            hidden = args.hidden_size
        dataset = stack.work / "bench.jsonl"
        total = write_pretokenized(dataset, [args.tokens] * args.samples, vocab=args.vocab)
        stack.start_api()
        stack.start_workers(args.processes)
        order = []
        for number in range(args.rounds):
            pair = ["engine", "fp8_e4m3"]
            order += pair if number % 2 == 0 else pair[::-1]
        for state_dtype in order:
            say(f"running the {state_dtype} job")
            job_id, _ = stack.submit(
                dataset, samples_per_shard=args.samples_per_shard, state_dtype=state_dtype
            )
            doc = stack.wait(job_id, timeout=3600)
            if doc["state"] != "succeeded":
                raise SystemExit(f"{state_dtype} job {doc['state']}: {doc.get('error')}")
            runs[state_dtype].append({"tok_s": job_rate(doc), "bytes": _bytes_written(doc)})
            shutil.rmtree(doc["output_dir"], ignore_errors=True)  # the disk holds one job's output at a time
    bf16, fp8 = runs["engine"], runs["fp8_e4m3"]
    result: dict[str, Any] = {
        "bench": "fp8",
        "engine": "external" if args.engine_url else "synthetic",
        "hidden_size": hidden,
        "samples": args.samples,
        "tokens": total,
        "processes": args.processes,
        "in_flight": args.processes * args.concurrency,
        "bf16_bytes": bf16[0]["bytes"],
        "fp8_bytes": fp8[0]["bytes"],
        "bytes_ratio": round(fp8[0]["bytes"] / bf16[0]["bytes"], 4),
        "bf16_tok_s": round(mean([r["tok_s"] for r in bf16])),
        "fp8_tok_s": round(mean([r["tok_s"] for r in fp8])),
        "bf16_tok_s_runs": [round(r["tok_s"]) for r in bf16],
        "fp8_tok_s_runs": [round(r["tok_s"]) for r in fp8],
    }
    result["tok_s_ratio"] = round(result["fp8_tok_s"] / result["bf16_tok_s"], 3)
    result.update(encode_cost(hidden))
    table([(key, str(value)) for key, value in result.items()])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
