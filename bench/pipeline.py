"""How much of the engine's prefill throughput survives the worker's capture pipeline.

Baseline: the same engine serving the same prompts with rids it does not capture (plain prefill). Measured:
the worker's unit pipeline (chat template, prefill with capture, dump read, validation, shard build and
write) over the same samples. Both run in this process against one engine, one after the other, and the
script prints their ratio. Works against the reference engine (started here by default) or any engine
that speaks hsx/contract.py (``--engine-url``, e.g. the patched SGLang on a GPU host).

    python bench/pipeline.py [--samples 64] [--concurrency 4] [--engine-url URL]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsx.jobs.repository import ClaimedUnit  # noqa: E402
from hsx.local_stack import free_port, hsx_command, local_stack, wait_http  # noqa: E402
from workers.dataset import iter_samples  # noqa: E402
from workers.engine_client import EngineClient  # noqa: E402


def encoded_samples(encoder: object, dataset: Path, n: int) -> list[list[int]]:
    out: list[list[int]] = []
    while len(out) < n:
        for _, messages in iter_samples(dataset, 0, 10**9):
            if isinstance(messages, list):
                out.append(encoder.encode(messages).input_ids)  # type: ignore[attr-defined]
            if len(out) == n:
                break
    return out


def plain_prefill(client: EngineClient, prompts: list[list[int]], concurrency: int) -> float:
    def one(ids: list[int]) -> None:
        client.prefill(ids, f"plain-{uuid.uuid4().hex}")

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, prompts))
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def run(engine_url: str, dataset: Path, samples: int, concurrency: int) -> dict[str, object]:
    from transformers import AutoTokenizer

    from workers.chat import ChatEncoder
    from workers.unit_processor import UnitProcessor

    client = EngineClient(engine_url)
    info = client.info()
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(info.model_path), True, 4096)
    prompts = encoded_samples(encoder, dataset, samples)
    # One warm-up pass so neither side pays for first-call allocations.
    plain_prefill(client, prompts[: min(4, len(prompts))], concurrency)
    baseline = plain_prefill(client, prompts, concurrency)

    work = Path(tempfile.mkdtemp(prefix="hsx-bench-"))
    data = work / "bench.jsonl"
    with data.open("w") as fh:
        rows = [m for _, m in iter_samples(dataset, 0, 10**9) if isinstance(m, list)]
        for i in range(samples):
            fh.write(json.dumps({"messages": rows[i % len(rows)]}) + "\n")
    processor = UnitProcessor(client, info, encoder, info.dump_dir, 30.0, concurrency, True)
    unit = ClaimedUnit(0, str(uuid.uuid4()), 0, 0, samples, 1, "bench")
    start = time.perf_counter()
    result = processor.process(unit, str(data), "auto", lambda: False)
    shard = result.builder.write(work / "shard-00000.safetensors")
    elapsed = time.perf_counter() - start
    pipeline = result.tokens / elapsed
    return {
        "engine": info.backend,
        "samples": samples,
        "tokens": result.tokens,
        "rejected": len(result.rejections),
        "concurrency": concurrency,
        "plain_prefill_tok_s": round(baseline, 1),
        "pipeline_tok_s": round(pipeline, 1),
        "ratio_pipeline_vs_plain": round(pipeline / baseline, 3),
        "shard_bytes": shard.bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine-url")
    parser.add_argument("--dataset", type=Path, default=REPO / "data" / "sample_chats.jsonl")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    if args.engine_url:
        print(json.dumps(run(args.engine_url, args.dataset, args.samples, args.concurrency), indent=2))
        return 0
    with local_stack(Path(tempfile.mkdtemp(prefix="hsx-bench-logs-"))) as stack:
        port = free_port()
        dumps = tempfile.mkdtemp(prefix="hsx-bench-dumps-")
        proc = stack.start(
            "engine",
            hsx_command(
                "engine",
                "--backend",
                "reference",
                "--port",
                str(port),
                "--disable-prefix-cache",
                "--dump-dir",
                dumps,
            ),
        )
        wait_http(f"http://127.0.0.1:{port}/health", 600, proc)
        print(
            json.dumps(
                run(f"http://127.0.0.1:{port}", args.dataset, args.samples, args.concurrency), indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
