"""Regenerate jobs (docs/regenerate.md): the option's validation, turn-by-turn generation whose ids are the
engine's own, the exactly-once text (a worker killed between generation and capture), accounting, and the
regenerated dataset as an output that re-captures bit for bit. Real reference engine (small
max_new_tokens), real PostgreSQL and Redis, real worker processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import REPO, Stack, make_stack

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
# No lease runs out on the clock (make_stack's 3600 s): the killed horse's worker releases its lease, and
# the reconciler, at half a second, queues the unit again.
FAST = {"heartbeat_seconds": "0.5", "reconcile_seconds": "0.5"}

TOOL_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
}
ROWS: list[Any] = [
    {
        "id": "plain",
        "messages": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4"}],
    },
    {
        "id": "two-turns",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Blue."},
        ],
    },
    {
        "id": "tool",
        "messages": [
            {"role": "user", "content": "Add 2 and 3."},
            TOOL_CALL,
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "It is 5."},
        ],
    },
    {
        "id": "ends-on-user",
        "messages": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Count to three."},
        ],
    },
    {"id": "prompt-only", "messages": [{"role": "user", "content": "Name a fruit."}]},
    "not json",
    {"id": "pretokenized", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
]
KEPT = ("plain", "two-turns", "tool", "ends-on-user", "prompt-only")


def write_rows(path: Path, rows: list[Any]) -> Path:
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def shard_samples(output_dir: str) -> dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    from hsx.loader import iter_samples

    return {s.index: (s.input_ids, s.loss_mask) for s in iter_samples(output_dir, verify_checksums=True)}


def download(stack: Stack, job_id: str) -> list[dict[str, Any]]:
    response = stack.client.get(f"/jobs/{job_id}/regenerated")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def kept_rows(db_url: str, job_id: str) -> dict[int, Any]:
    from sqlalchemy import select

    from hsx.server.db.regenerate_models import RegeneratedSample
    from hsx.server.db.session import session_scope

    with session_scope(db_url) as session:
        rows = session.scalars(select(RegeneratedSample).where(RegeneratedSample.job_id == job_id))
        return {r.sample_index: (r.attempt, r.reason, list(r.input_ids or [])) for r in rows}


# --- the option ---------------------------------------------------------------------------------------------


def test_the_option_is_off_by_default_and_strict() -> None:
    from hsx.server.job_options import JobOptions

    assert JobOptions().regenerate is None
    options = JobOptions.model_validate({"regenerate": {"turns": "last", "temperature": 1, "seed": 3}})
    assert options.regenerate is not None and options.regenerate.temperature == 1.0
    assert JobOptions.from_stored(options.stored()) == options
    for bad in (
        {"turns": "first"},
        {"max_new_tokens": 0},
        {"temperature": 2.5},
        {"top_p": 0},
        {"seed": -1},
        {"on_length": "truncate"},
        {"typo": 1},
        {"max_new_tokens": "16"},
    ):
        with pytest.raises(ValidationError):
            JobOptions.model_validate({"regenerate": bad})
    with pytest.raises(ValidationError, match="chat_template"):
        JobOptions.model_validate({"regenerate": {}, "chat_template": False})


@postgres_only
def test_a_bad_regenerate_option_is_a_422_naming_the_field(
    db_url: str, redis_url: str, engine_synthetic: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = make_stack(db_url, redis_url, engine_synthetic.url, tmp_path, monkeypatch)
    dataset = write_rows(tmp_path / "rows.jsonl", ROWS[:1])
    for bad, field in (
        ({"top_p": 1.5}, "top_p"),
        ({"nope": 1}, "nope"),
        ({"max_new_tokens": -4}, "max_new_tokens"),
    ):
        response = stack.client.post(
            "/jobs", json={"dataset_uri": str(dataset), "options": {"regenerate": bad}}
        )
        assert response.status_code == 422, response.text
        body = response.json()
        assert (
            set(body) >= {"error", "detail"} and "regenerate" in body["detail"] and field in body["detail"]
        ), body
    # A plain job's document has no regenerate section; asking for the download of one is a 409.
    doc = stack.submit(dataset)
    assert doc["regenerate"] is None and doc["options"]["regenerate"] is None
    refused = stack.client.get(f"/jobs/{doc['id']}/regenerated")
    assert refused.status_code == 409 and refused.json()["error"] == "not_regenerated", refused.text


def test_max_new_tokens_that_leave_no_room_for_a_prompt_make_the_engine_unfit() -> None:
    """What the issue's new user met: 32,768 new tokens against an 8,192-token context (every generation
    refused, every sample generation_rejected). The worker's gate, hsx verify --job and POST /jobs apply
    the same check."""
    from hsx.contract import EngineInfo
    from hsx.engine import fitness as engine_fitness

    info = EngineInfo("synthetic", "m", 8, 64, "bfloat16", [1, 3, 4], [2, 4, 5, 8], "/d", False)
    info.context_length = 8192
    checks = engine_fitness.option_checks(info, {"regenerate": {"max_new_tokens": 32768}})
    assert [c.code for c in checks] == ["max_new_tokens_exceeds_context"]
    assert "32768" in checks[0].detail and "8192" in checks[0].detail
    assert engine_fitness.option_checks(info, {"regenerate": {"max_new_tokens": 8191}}) == []
    assert engine_fitness.option_checks(info, {"max_length": 8192}) == []  # not a regenerate job
    reason = engine_fitness.unfit_reason(info, {"regenerate": {"max_new_tokens": 8192}})
    assert reason is not None and "regenerate.max_new_tokens 8192" in reason


@postgres_only
def test_a_regenerate_job_that_cannot_keep_a_sample_is_a_422_at_submit(
    db_url: str, redis_url: str, engine_synthetic: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a max_length past the engine's context is: accepted, such a job "succeeded" with 0 samples."""
    from tests.fixtures.synthetic import write_pretokenized

    stack = make_stack(db_url, redis_url, engine_synthetic.url, tmp_path, monkeypatch)
    context = engine_synthetic.info.context_length
    chats = write_rows(tmp_path / "rows.jsonl", ROWS[:2])
    too_many = stack.client.post(
        "/jobs", json={"dataset_uri": str(chats), "options": {"regenerate": {"max_new_tokens": context}}}
    )
    assert too_many.status_code == 422, too_many.text
    assert too_many.json()["error"] == "max_new_tokens_exceeds_context"
    assert f"context length {context}" in too_many.json()["detail"]

    pretokenized = write_pretokenized(tmp_path / "ids.jsonl", [20, 30])
    no_turns = stack.client.post(
        "/jobs", json={"dataset_uri": str(pretokenized), "options": {"regenerate": {}}}
    )
    assert no_turns.status_code == 422, no_turns.text
    assert no_turns.json()["error"] == "regenerate_needs_messages"
    assert "pre-tokenized" in no_turns.json()["detail"]

    assert stack.client.get("/jobs").json()["total"] == 0
    # The same records and options within the rules are accepted.
    assert stack.submit(chats, regenerate={"max_new_tokens": 16})["state"] == "queued"
    assert stack.submit(pretokenized)["state"] == "queued"


# --- turn by turn, against the engine ----------------------------------------------------------------------


def engine_turns(client: Any, max_new_tokens: int) -> Any:
    """The worker's turn generator over a real engine: greedy, as the stage asks."""
    from hsx.engine.regenerate_contract import GenerationParams
    from workers.regeneration.turns import GeneratedTurn

    def generate(prompt: list[int], turn: int) -> GeneratedTurn:
        done = client.generate(
            prompt, GenerationParams(max_new_tokens=max_new_tokens), f"hsxgen-turns-{turn}"
        )
        return GeneratedTurn(done.output_ids, done.finish_reason)

    return generate


def test_under_last_the_earlier_turns_are_kept_and_masked_as_in_any_job(
    tokenizer: Any, engine_nocache: Any
) -> None:
    from hsx.engine.client import EngineClient
    from hsx.server.job_options import RegenerateOptions
    from workers.chat import ChatEncoder
    from workers.regeneration.turns import TurnRegenerator

    conversation = ROWS[1]["messages"]
    regenerator = TurnRegenerator(tokenizer, RegenerateOptions(turns="last", max_new_tokens=5), 4096)
    with EngineClient(engine_nocache.url) as client:
        done = regenerator.regenerate(conversation, engine_turns(client, 5))
    assert done.messages[:4] == conversation[:4] and done.messages[4]["content"] != conversation[4]["content"]
    # Up to the rewritten turn, the ids and mask are exactly those any job gives the kept conversation.
    before = ChatEncoder(tokenizer).encode(done.messages)
    text = tokenizer.apply_chat_template(conversation[:4], tokenize=False, add_generation_prompt=True)
    prompt = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert done.input_ids[:prompt] == before.input_ids[:prompt]
    assert done.loss_mask[:prompt] == before.loss_mask[:prompt] and any(done.loss_mask[:prompt])
    # After it: the generated ids, masked, then the template's closing, not.
    generated = done.generated_tokens
    assert done.loss_mask[prompt:] == [1] * generated + [0] * (len(done.input_ids) - prompt - generated)


def test_a_turn_stopped_on_max_new_tokens_is_kept_and_counted_or_dropped(
    tokenizer: Any, engine_nocache: Any
) -> None:
    from hsx.engine.client import EngineClient
    from hsx.server.job_options import RegenerateOptions
    from workers.regeneration.turns import GENERATION_LENGTH, RegenerateError, TurnRegenerator

    conversation = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    with EngineClient(engine_nocache.url) as client:
        kept = TurnRegenerator(tokenizer, RegenerateOptions(max_new_tokens=2), 4096).regenerate(
            conversation, engine_turns(client, 2)
        )
        assert kept.finish_reasons == ["length"] and kept.turns_at_length == 1 and kept.generated_tokens == 2
        # Cut short, the turn has no end-of-turn token of its own: the template closes it, unmasked.
        assert kept.loss_mask[-kept.generated_tokens - 2 :] == [1, 1, 0, 0]
        drop = TurnRegenerator(tokenizer, RegenerateOptions(max_new_tokens=2, on_length="drop"), 4096)
        with pytest.raises(RegenerateError) as refused:
            drop.regenerate(conversation, engine_turns(client, 2))
    assert refused.value.reason == GENERATION_LENGTH


# --- a regenerate job end to end ---------------------------------------------------------------------------


@postgres_only
def test_a_regenerate_job_captures_the_engines_own_ids_and_its_dataset_recaptures_bit_for_bit(
    stack: Stack, tmp_path: Path
) -> None:
    from hsx.engine.client import EngineClient
    from hsx.engine.regenerate_contract import GenerationParams

    dataset = write_rows(tmp_path / "rows.jsonl", ROWS)
    regenerate = {"max_new_tokens": 6, "temperature": 0.0}
    doc = stack.submit(dataset, samples_per_shard=3, regenerate=regenerate)
    assert doc["options"]["regenerate"]["max_new_tokens"] == 6
    stack.start_worker()
    doc = stack.wait(doc["id"], timeout=240)
    assert doc["state"] == "succeeded", (doc, stack.logs())

    # Accounting: every input row is regenerated or rejected with a reason, once.
    progress, regen = doc["progress"], doc["regenerate"]
    assert doc["rejections"] == {"malformed_json": 1, "regenerate_needs_messages": 1}, doc["rejections"]
    assert regen["samples_regenerated"] + sum(doc["rejections"].values()) == len(ROWS)
    assert progress["samples_done"] == regen["samples_regenerated"] == len(KEPT)
    # The tool-call turn is kept; the open question and the prompt alone are answered.
    assert regen["turns_generated"] == 1 + 2 + 1 + 2 + 1
    assert 0 < regen["generated_tokens"] <= 6 * regen["turns_generated"]
    assert regen["captured_tokens"] == progress["tokens"] and regen["generated_tokens_per_second"] > 0

    # /metrics counts what the workers generated (they push it at the end of each unit).
    metrics = stack.client.get("/metrics").text
    pushed = [line for line in metrics.splitlines() if line.startswith("hsx_generated_tokens_total ")]
    assert pushed and float(pushed[0].split()[1]) == regen["generated_tokens"], pushed

    lines = download(stack, doc["id"])
    assert [line["id"] for line in lines] == list(KEPT)
    captured = shard_samples(doc["output_dir"])
    assert sorted(captured) == [line["sample_index"] for line in lines]
    with EngineClient(stack.env["HSX_ENGINE_URL"]) as client:
        for line in lines:
            ids, mask = captured[line["sample_index"]]
            # The shard holds exactly the kept text's ids and mask.
            assert ids.tolist() == line["input_ids"] and mask.tolist() == line["loss_mask"]
            assert line["generation"]["max_new_tokens"] == 6 and line["messages"][-1]["role"] == "assistant"
            spans = masked_runs(line["loss_mask"])
            if line["id"] == "tool":
                # The tool call is kept as written, and trained as in any job; the answer after it is new.
                assert line["messages"][1] == TOOL_CALL and len(spans) == 2
                generated = [spans[-1]]
            else:
                assert sum(line["loss_mask"]) == line["generation"]["generated_tokens"]
                generated = spans
            assert len(generated) == len(line["generation"]["finish_reasons"])
            # Each generated span is the engine's own answer to the ids before it (greedy: the same again).
            for (start, end), reason in zip(generated, line["generation"]["finish_reasons"], strict=True):
                again = client.generate(
                    line["input_ids"][:start], GenerationParams(max_new_tokens=6), f"hsxgen-test-{start}"
                )
                assert again.output_ids == line["input_ids"][start:end] and again.finish_reason == reason
    # The user turns are kept as written; every assistant turn is the engine's (the last one appended).
    opened = lines[3]["messages"]
    assert [opened[0], opened[2]] == [ROWS[3]["messages"][0], ROWS[3]["messages"][2]] and len(opened) == 4
    assert opened[1]["content"] != ROWS[3]["messages"][1]["content"]
    assert lines[4]["messages"][0] == ROWS[4]["messages"][0] and len(lines[4]["messages"]) == 2

    # The download (through the CLI, over real HTTP), submitted again without regenerate, captures the same
    # ids and masks bit for bit.
    from app.main import create_app
    from hsx.cli.main import main as hsx_main

    again_path = tmp_path / "regenerated.jsonl"
    with serve_in_thread(create_app()) as api:
        assert hsx_main(["regenerated", doc["id"], "-o", str(again_path), "--api-url", api]) == 0
        assert hsx_main(["regenerated", "no-such-job", "-o", str(tmp_path / "none"), "--api-url", api]) == 2
    assert not (tmp_path / "none").exists() and not list(tmp_path.glob("*.partial"))
    assert [json.loads(line) for line in again_path.read_text().splitlines()] == lines
    recapture = stack.wait(stack.submit(again_path, samples_per_shard=2)["id"], timeout=240)
    assert recapture["state"] == "succeeded" and recapture["progress"]["samples_rejected"] == 0, recapture
    recaptured = shard_samples(recapture["output_dir"])
    assert len(recaptured) == len(lines)
    for k, line in enumerate(lines):
        ids, mask = recaptured[k]
        first_ids, first_mask = captured[line["sample_index"]]
        assert ids.dtype == first_ids.dtype and ids.tobytes() == first_ids.tobytes()
        assert mask.dtype == first_mask.dtype and mask.tobytes() == first_mask.tobytes()


def masked_runs(mask: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for position, bit in enumerate(mask):
        if bit and (not runs or runs[-1][1] != position):
            runs.append((position, position + 1))
        elif bit:
            runs[-1] = (runs[-1][0], position + 1)
    return runs


# --- exactly once, the text included ----------------------------------------------------------------------


@postgres_only
def test_a_worker_killed_between_generation_and_capture_leaves_the_kept_text_to_the_next_attempt(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = make_stack(db_url, redis_url, engine_nocache.url, tmp_path, monkeypatch, **FAST)
    try:
        dataset = write_rows(tmp_path / "rows.jsonl", ROWS[:4])
        # Sampled, with no seed: a second generation would almost surely write another text.
        regenerate = {"max_new_tokens": 12, "temperature": 1.0, "turns": "last"}
        job_id = stack.submit(dataset, samples_per_shard=4, regenerate=regenerate)["id"]
        marker = tmp_path / "crashed"
        crash = {"HSX_CRASH_AT": "after_regenerate_durable", "HSX_CRASH_ONCE_FILE": str(marker)}
        # The killed work horse's worker goes on (it counts the death) and takes the unit again.
        stack.run_burst(timeout=180, extra_env=crash)
        assert marker.exists(), stack.logs()
        doc = stack.job(job_id)
        if doc["state"] not in ("succeeded", "failed"):
            stack.start_worker()
            doc = stack.wait(job_id, timeout=240)
        assert doc["state"] == "succeeded", (doc, stack.logs())
        units = stack.client.get(f"/jobs/{job_id}/units").json()
        attempts = [u["attempt"] for u in (units["items"] if isinstance(units, dict) else units)]
        assert attempts == [2], units
        logs = "".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("worker-*.log")))
        assert "unit 0: 4 samples regenerated and kept, 0 kept by an earlier attempt" in logs, logs[-4000:]
        assert "unit 0: 0 samples regenerated and kept, 4 kept by an earlier attempt" in logs, logs[-4000:]
        # Every text was kept by the first attempt, and the second captured those: with sampling on and no
        # seed, a second generation would have given other ids.
        first = kept_rows(stack.env["HSX_DATABASE_URL"], job_id)
        assert sorted(first) == [0, 1, 2, 3] and all(a == 1 and r is None for a, r, _ in first.values()), (
            first
        )
        captured = shard_samples(doc["output_dir"])
        assert {i: ids.tolist() for i, (ids, _) in captured.items()} == {
            i: ids for i, (_, _, ids) in first.items()
        }
        assert doc["regenerate"]["samples_regenerated"] + doc["progress"]["samples_rejected"] == 4
    finally:
        stack.stop_workers()
        from hsx.server.settings import get_settings

        get_settings.cache_clear()


@postgres_only
def test_metrics_show_what_running_regenerate_jobs_generate(
    db_url: str, redis_url: str, engine_synthetic: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generation rate beside the capture's: kept texts' tokens over the time the job has run."""
    from datetime import datetime, timedelta, timezone

    from hsx.server.db.models import Job, JobState, WorkUnit
    from hsx.server.db.regenerate_models import RegeneratedSample
    from hsx.server.db.session import session_scope

    stack = make_stack(db_url, redis_url, engine_synthetic.url, tmp_path, monkeypatch)
    with session_scope(db_url) as session:
        session.add(
            Job(
                id="regen-metrics",
                state=JobState.running.value,
                dataset_uri="x",
                dataset_path="x",
                options={"regenerate": {}},
                request_hash="0" * 64,
                output_dir=str(tmp_path / "out"),
                started_at=datetime.now(timezone.utc) - timedelta(seconds=100),
            )
        )
        session.flush()
        unit = WorkUnit(job_id="regen-metrics", unit_index=0, sample_start=0, sample_end=2)
        session.add(unit)
        session.flush()
        session.add_all(
            RegeneratedSample(
                job_id="regen-metrics", unit_id=unit.id, attempt=1, sample_index=i, generated_tokens=500
            )
            for i in range(2)
        )
    metrics = stack.client.get("/metrics").text
    rate = [line for line in metrics.splitlines() if line.startswith("hsx_generated_tokens_per_second ")]
    assert rate and 8.0 < float(rate[0].split()[1]) <= 10.0, rate  # 1,000 tokens over 100 s and a little
    doc = stack.job("regen-metrics")["regenerate"]
    assert doc["generated_tokens"] == 1000 and doc["samples_regenerated"] == 2 and doc["samples_failed"] == 0


# --- composes with the other options ----------------------------------------------------------------------


def test_a_regenerate_job_reads_parquet_from_s3_keeps_fp8_states_streams_and_publishes_to_s3(
    engine_synthetic: Any, s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regeneration changes what capture is given, not how it is read, stored, streamed or published: a
    Parquet dataset in the object store, fp8 states, consume retention, the output published to the store
    (synthetic engine: no model value is checked here)."""
    datasets = pytest.importorskip("datasets", reason="the interop extra provides datasets for the fixture")
    from hsx.server.db.migrate import upgrade
    from tests.conftest import REDIS_URL

    chats = REPO / "tests" / "data" / "short_chats.jsonl"
    parquet = tmp_path / "chats.parquet"
    datasets.Dataset.from_json(str(chats), cache_dir=str(tmp_path / "hf")).to_parquet(str(parquet))
    s3_bucket.client().upload_file(str(parquet), s3_bucket.name, "datasets/chats.parquet")
    db_url = f"sqlite:///{tmp_path / 'hsx.sqlite3'}"
    upgrade(db_url)
    stack = make_stack(
        db_url, REDIS_URL, engine_synthetic.url, tmp_path, monkeypatch,
        s3_endpoint_url=s3_bucket.server.url, allowed_buckets=s3_bucket.name,
        allowed_uri_schemes="file,s3", output_uri=f"s3://{s3_bucket.name}/outputs",
    )  # fmt: skip
    try:
        options: dict[str, Any] = {
            "samples_per_shard": 5,
            "state_dtype": "fp8_e4m3",
            "retention": "consume",
            "buffer_cap_bytes": 1 << 30,
            "regenerate": {"seed": 11, "max_new_tokens": 8},
        }
        job = stack.submit(f"s3://{s3_bucket.name}/datasets/chats.parquet", **options)
        assert stack.run_burst(timeout=300) == 0, stack.logs()
        doc = stack.wait(job["id"], timeout=120)
        assert doc["state"] == "succeeded", (doc, stack.logs())
        lines = download(stack, doc["id"])
    finally:
        stack.stop_workers()
    total = sum(1 for line in chats.read_text().splitlines() if line.strip())
    regen = doc["regenerate"]
    assert doc["stream"] is not None and doc["options"]["retention"] == "consume"
    assert regen["samples_regenerated"] + regen["samples_failed"] == total == doc["progress"]["samples_total"]
    assert doc["progress"]["samples_done"] == regen["samples_regenerated"] == len(lines) > 0
    assert all(line["generation"]["seeds"] and None not in line["generation"]["seeds"] for line in lines)

    copy = tmp_path / "copy"
    prefix = f"outputs/{doc['id']}/"
    for key in s3_bucket.keys(prefix):
        (copy / key[len(prefix) :]).parent.mkdir(parents=True, exist_ok=True)
        s3_bucket.client().download_file(s3_bucket.name, key, str(copy / key[len(prefix) :]))
    from hsx.loader import iter_samples

    published = {s.index: s for s in iter_samples(copy, raw_fp8=True)}  # checksums against the manifest
    assert sorted(published) == [line["sample_index"] for line in lines]
    for line in lines:
        sample = published[line["sample_index"]]
        assert sample.input_ids.tolist() == line["input_ids"]
        assert sample.loss_mask.tolist() == line["loss_mask"]
        assert sample.hidden_state_scale is not None, "the states are fp8 codes with their scales"
