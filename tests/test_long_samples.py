"""Long samples on the synthetic engine: a sample the engine cannot take is rejected before it is sent, with
the reason, and a job of 32,768-token samples runs in a worker whose memory does not grow with them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from hsx import contract
from tests.fixtures.stack import Stack, make_stack
from tests.fixtures.synthetic import Engines, Synthetic, write_pretokenized
from tests.test_job_recovery import rejections, runner

# The synthetic engine's default shape in tests: hidden 32, 8 layers, 3 aux layers + the final state.
TENSORS, HIDDEN = 4, 32
BYTES_PER_TOKEN = 4 + TENSORS * HIDDEN * 2


@pytest.fixture
def stack_on(
    db_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[object]:
    """``stack_on(engine)``: a stack whose jobs run on that engine; a worker waits 3 s for a dump."""
    from hsx.server.settings import get_settings

    stacks: list[Stack] = []

    def make(engine: Synthetic) -> Stack:
        stack = make_stack(db_url, redis_url, engine.url, tmp_path, monkeypatch, dump_wait_seconds="3")
        stacks.append(stack)
        return stack

    try:
        yield make
    finally:
        for stack in stacks:
            stack.stop_workers()
        get_settings.cache_clear()


def engine_log(engines: Engines) -> str:
    return "\n".join(p.read_text(errors="replace") for p in engines.stack.log_dir.glob("*.log"))


def test_a_sample_whose_dump_the_engine_cannot_write_is_rejected_before_it_is_sent(
    engines: Engines, stack_on: object
) -> None:
    # The engine writes dumps of at most 1,000 tokens' worth; like the SGLang plugin, it answers a larger
    # one and never writes it (a worker that sent it would wait for a dump that never comes).
    engine = engines.start("--max-dump-bytes", str(1000 * BYTES_PER_TOKEN))
    stack = stack_on(engine)  # type: ignore[operator]
    data = write_pretokenized(stack.tmp / "d.jsonl", [40, 1800, 1000, 1001])
    job_id = stack.submit(data, samples_per_shard=2)["id"]
    outcome = runner(engine.url)(job_id).run()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", (outcome, doc)
    rejected = rejections(stack, job_id)
    assert {i: r["reason"] for i, r in rejected.items()} == {1: "dump_too_large", 3: "dump_too_large"}
    assert rejected[1]["record_id"] == "rec-1"
    assert f"its dump is {1800 * BYTES_PER_TOKEN:,} bytes" in rejected[1]["detail"], rejected[1]
    assert f"at most {1000 * BYTES_PER_TOKEN:,}" in rejected[1]["detail"], rejected[1]
    from hsx.loader import iter_samples

    assert {s.index: len(s.input_ids) for s in iter_samples(doc["output_dir"])} == {0: 40, 2: 1000}
    # Never sent: the engine was asked for no dump it could not write.
    assert "not written" not in engine_log(engines)
    # A retry (on an engine that can hold them, say) takes them up again: an engine-side reason.
    retried = stack.client.post(f"/jobs/{job_id}/retry")
    assert retried.status_code == 200, retried.text
    assert retried.json()["progress"]["units_total"] == 4, "a retry unit for each of the two"


def test_a_sample_longer_than_the_engine_takes_is_rejected_before_it_is_sent(
    engines: Engines, stack_on: object
) -> None:
    # An engine whose context is 1,024 tokens but which takes prompts of at most 1,017 (SGLang's scheduler
    # refuses the last 7 positions): a job may ask for max_length 1,024, and a 1,018-token sample must not
    # reach the engine.
    engine = engines.start("--context-length", "1024", "--max-prompt-tokens", "1017")
    stack = stack_on(engine)  # type: ignore[operator]
    data = write_pretokenized(stack.tmp / "d.jsonl", [1017, 1018, 1500, 12])
    job_id = stack.submit(data, samples_per_shard=2, max_length=1024)["id"]
    outcome = runner(engine.url)(job_id).run()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", (outcome, doc)
    rejected = rejections(stack, job_id)
    assert {i: r["reason"] for i, r in rejected.items()} == {1: "too_long", 2: "too_long"}, rejected
    assert rejected[1]["detail"] == "1018 tokens; the engine takes prompts of at most 1017"
    # Record 2 was cut to max_length first (the job's truncation), then refused for the engine's limit.
    assert rejected[2]["detail"] == "1024 tokens; the engine takes prompts of at most 1017"
    from hsx.loader import iter_samples

    assert {s.index: len(s.input_ids) for s in iter_samples(doc["output_dir"])} == {0: 1017, 3: 12}


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB$", text, re.MULTILINE)
    assert match, field
    return int(match.group(1))


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the worker's memory, whatever its table
def test_a_worker_copies_32k_token_samples_in_bounded_memory(
    engines: Engines, stack_on: object, tmp_path: Path
) -> None:
    """The worker (in this process) streams each dump into the shard through one chunk buffer: its peak
    RSS over a job of three 32,768-token samples at hidden 1,024 (268 MB of states each) grows by less
    than what the shard writer must hold (the unit's ids and masks) plus a fixed allowance, far below one
    sample's states."""
    tokens, hidden = 32768, 1024
    engine = engines.start("--hidden-size", str(hidden), "--context-length", str(tokens))
    stack = stack_on(engine)  # type: ignore[operator]
    data = write_pretokenized(stack.tmp / "d.jsonl", [tokens] * 3)
    job_id = stack.submit(data, samples_per_shard=3, max_length=tokens)["id"]
    make = runner(engine.url, engine_concurrency=2)
    job_runner = make(job_id)
    # Warm the paths a first unit takes (imports, the HTTP client) on a short job first, so that the peak
    # below is the samples' alone.
    warm = write_pretokenized(tmp_path / "warm.jsonl", [64] * 2)
    assert make(stack.submit(warm, samples_per_shard=2)["id"]).run().summary
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)
    before = _status_kib("VmRSS")
    outcome = job_runner.run()
    peak = _status_kib("VmHWM")
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", (outcome, doc)
    from hsx.loader import iter_samples

    assert [len(s.input_ids) for s in iter_samples(doc["output_dir"])] == [tokens] * 3
    sample_states = contract.dump_bytes(tokens, hidden, TENSORS, 2)
    # What the unit must hold to write its shard's token tensors: every sample's ids and mask as the record
    # reader's Python lists (about 36 bytes a token each) and as arrays (5 bytes a token), for the whole
    # unit; plus 64 MiB for buffers, threads and the allocator's slack.
    bound_kib = (3 * tokens * (2 * 36 + 5) + (64 << 20)) // 1024
    grown = peak - before
    assert grown < bound_kib, f"peak RSS grew {grown} KiB over a job of 32K-token samples; bound {bound_kib}"
    assert bound_kib * 1024 < sample_states / 2, "the bound is far below one sample's states"
