"""Success that hides no loss, and progress that shows: truncation is the job's choice and is counted in
the job, the manifest and per sample; a sample too long is reported as too long; a max_length past the
engine's context is refused at submit; rejections name the record's own id; progress moves before a unit
commits; the output's size is projected at prepare, shown, and a job that cannot fit is refused.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.stack import REPO, Stack, make_stack
from tests.fixtures.synthetic import HIDDEN, Engines, Synthetic, write_pretokenized
from tests.test_job_recovery import published, rejections, runner

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


@pytest.fixture
def synth(
    db_url: str, redis_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Stack, Synthetic]]:
    from hsx.server.settings import get_settings

    engine = engines.start("--tokenizer", "default", "--context-length", "4096")
    stack = make_stack(db_url, redis_url, engine.url, tmp_path, monkeypatch, heartbeat_seconds="0.2")
    try:
        yield stack, engine
    finally:
        get_settings.cache_clear()


def truncations(stack: Stack, job_id: str) -> dict[int, dict[str, Any]]:
    page = stack.client.get(f"/jobs/{job_id}/truncations", params={"limit": 1000})
    assert page.status_code == 200, page.text
    return {t["sample_index"]: t for t in page.json()["items"]}


def lengths_in_shards(doc: dict[str, Any]) -> dict[int, int]:
    from hsx.loader import iter_samples

    return {s.index: len(s.input_ids) for s in iter_samples(doc["output_dir"])}


# --- truncation --------------------------------------------------------------------------------------------

# Record 0 fits, 1 and 3 are longer than max_length with answers inside it, 2 answers only past it.
LENGTHS = [12, 40, 40, 25]
ANSWER_FROM = [2, 4, 30, 10]


def test_truncate_keeps_cut_samples_and_counts_them_everywhere(synth: tuple[Stack, Synthetic]) -> None:
    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", LENGTHS, ANSWER_FROM)
    job_id = stack.submit(data, max_length=16, samples_per_shard=2)["id"]
    assert stack.job(job_id)["options"]["truncation"] == "truncate", "the default"
    runner(engine.url)(job_id).run()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded", doc
    assert lengths_in_shards(doc) == {0: 12, 1: 16, 3: 16}
    cut = truncations(stack, job_id)
    assert {i: (t["tokens"], t["kept"], t["record_id"]) for i, t in cut.items()} == {
        1: (40, 16, "rec-1"),
        3: (25, 16, "rec-3"),
    }
    [too_long] = rejections(stack, job_id).values()
    assert (too_long["sample_index"], too_long["reason"], too_long["record_id"]) == (2, "too_long", "rec-2")
    assert "no assistant token within the first 16" in too_long["detail"]
    assert doc["progress"]["samples_truncated"] == 2
    manifest = json.loads(Path(doc["manifest"]).read_text())
    assert manifest["counts"] == {"samples": 3, "rejected": 1, "tokens": 44, "truncated": 2}


@postgres_only
def test_reject_refuses_every_sample_longer_than_max_length(synth: tuple[Stack, Synthetic]) -> None:
    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", LENGTHS, ANSWER_FROM)
    job_id = stack.submit(data, max_length=16, truncation="reject", samples_per_shard=4)["id"]
    runner(engine.url)(job_id).run()
    doc = stack.job(job_id)
    assert doc["state"] == "succeeded" and published(doc) == [0]
    rejected = rejections(stack, job_id)
    assert {i: r["reason"] for i, r in rejected.items()} == {1: "too_long", 2: "too_long", 3: "too_long"}
    assert "40 tokens, max_length is 16" in rejected[1]["detail"]
    assert truncations(stack, job_id) == {} and doc["progress"]["samples_truncated"] == 0


@postgres_only
def test_a_chat_sample_whose_answer_lies_past_max_length_is_too_long(synth: tuple[Stack, Synthetic]) -> None:
    stack, engine = synth
    long_question = " ".join(f"word{i}" for i in range(300))
    records = [
        {
            "id": "short",
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        },
        {
            "conversation_id": 77,
            "messages": [
                {"role": "user", "content": long_question},
                {"role": "assistant", "content": "That was long."},
            ],
        },
    ]
    data = stack.tmp / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"id": "broken", "messages": [\n')
    job_id = stack.submit(data, max_length=128)["id"]
    runner(engine.url)(job_id).run()
    rejected = rejections(stack, job_id)
    assert {i: (r["reason"], r["record_id"]) for i, r in rejected.items()} == {
        1: ("too_long", "77"),
        2: ("malformed_json", "broken"),
    }
    assert "no assistant token within the first 128" in rejected[1]["detail"]


@postgres_only
def test_max_length_past_the_engine_context_and_other_aux_layers_are_refused_at_submit(
    synth: tuple[Stack, Synthetic],
) -> None:
    stack, _engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [20])
    too_long = stack.client.post("/jobs", json={"dataset_uri": str(data), "options": {"max_length": 8192}})
    assert too_long.status_code == 422, too_long.text
    assert too_long.json()["error"] == "max_length_exceeds_context"
    assert "context length 4096" in too_long.json()["detail"]
    other_layers = stack.client.post(
        "/jobs", json={"dataset_uri": str(data), "options": {"aux_layers": [1, 2]}}
    )
    assert other_layers.status_code == 422 and other_layers.json()["error"] == "aux_layers_mismatch"
    assert stack.client.get("/jobs").json()["total"] == 0
    assert stack.submit(data, max_length=4096)["state"] == "queued"


# --- progress before a unit commits ------------------------------------------------------------------------


@postgres_only
def test_progress_and_eta_move_before_a_single_unit_job_commits(
    synth: tuple[Stack, Synthetic], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.server.faults import crash_point as real_crash_point

    stack, engine = synth
    job_id = stack.submit(write_pretokenized(stack.tmp / "d.jsonl", [20] * 6), samples_per_shard=6)["id"]
    processed, release = threading.Event(), threading.Event()

    def hold_before_commit(name: str) -> None:
        real_crash_point(name)
        if name == "mid_unit":  # every sample is in the staged shard, nothing is committed
            processed.set()
            release.wait(30)

    monkeypatch.setattr("workers.unit_pipeline.crash_point", hold_before_commit)
    worker = threading.Thread(target=lambda: runner(engine.url)(job_id).run())
    worker.start()
    try:
        assert processed.wait(30)
        deadline = time.monotonic() + 10
        while (doc := stack.job(job_id))["progress"]["in_flight"] is None:
            assert time.monotonic() < deadline, doc
            time.sleep(0.05)
        progress = doc["progress"]
        assert progress["units_done"] == 0 and progress["samples_done"] == 6, progress
        assert progress["in_flight"] == {"samples_done": 6, "samples_rejected": 0, "tokens": 120}
        assert progress["eta_seconds"] is not None and progress["fraction"] == 1.0
    finally:
        release.set()
        worker.join(30)
    done = stack.job(job_id)["progress"]
    assert (done["samples_done"], done["units_done"], done["in_flight"]) == (6, 1, None)


# --- the output's size -----------------------------------------------------------------------------------


@postgres_only
@pytest.mark.parametrize("state_dtype", ["engine", "fp8_e4m3"])
def test_the_output_size_is_projected_exactly_for_pretokenized_records(
    synth: tuple[Stack, Synthetic], state_dtype: str
) -> None:
    stack, engine = synth
    data = write_pretokenized(stack.tmp / "d.jsonl", [30, 50, 70, 20, 45])
    job_id = stack.submit(data, samples_per_shard=2, state_dtype=state_dtype)["id"]
    runner(engine.url)(job_id).run()
    doc = stack.job(job_id)
    output = doc["output"]
    written = sum(p.stat().st_size for p in Path(doc["output_dir"]).glob("shard-*.safetensors"))
    assert output["projection_exact"] is True and output["bytes_written"] == written
    # tokens x (3 aux + final) x (hidden x bf16, or hidden x fp8 plus a float32 scale)
    states = 215 * 4 * (HIDDEN * 2 if state_dtype == "engine" else HIDDEN + 4)
    assert states < written <= output["projected_bytes"] <= written + 16 * 3, (output, written)
    assert output["free_bytes_at_prepare"] > output["projected_bytes"]


@postgres_only
def test_the_output_size_of_chat_records_is_an_estimate_that_covers_the_output(
    synth: tuple[Stack, Synthetic],
) -> None:
    stack, engine = synth
    job_id = stack.submit(REPO / "data" / "sample_chats.jsonl", samples_per_shard=8)["id"]
    runner(engine.url)(job_id).run()
    output = stack.job(job_id)["output"]
    assert output["projection_exact"] is False and output["projection_basis"].startswith("estimate:")
    assert output["bytes_written"] <= output["projected_bytes"] <= 1.2 * output["bytes_written"], output


@postgres_only
def test_a_job_that_cannot_fit_is_refused_with_the_figures(
    db_url: str, redis_url: str, engines: Engines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_faults import tmpfs

    engine = engines.start()
    with tmpfs(tmp_path / "small", "256k") as out:
        stack = make_stack(db_url, redis_url, engine.url, tmp_path, monkeypatch, output_dir=str(out))
        fits = stack.submit(write_pretokenized(tmp_path / "fits.jsonl", [20] * 4))["id"]
        too_big = stack.submit(write_pretokenized(tmp_path / "big.jsonl", [300] * 8))["id"]
        runner(engine.url)(too_big).run()
        doc = stack.job(too_big)
        assert doc["state"] == "failed" and doc["progress"]["units_total"] == 0
        assert doc["error"].startswith(f"not enough space for the output in {out}"), doc["error"]
        assert "needs exactly" in doc["error"] and "are free" in doc["error"]
        assert list((out / too_big).glob("shard-*")) == []
        runner(engine.url)(fits).run()
        assert stack.job(fits)["state"] == "succeeded"
        # A refused job is retried from its start: prepared (and measured) again.
        assert stack.client.post(f"/jobs/{too_big}/retry").json()["state"] == "queued"
        runner(engine.url, check_output_space=False)(too_big).run(max_units=0)
        assert stack.job(too_big)["progress"]["units_total"] == 1


def test_record_ids_are_read_from_records_and_from_broken_lines() -> None:
    from hsx.server.ingest import parse_record_with_id

    assert parse_record_with_id(b'{"id": "a-1", "input_ids": [5, 6]}')[1] == "a-1"
    assert parse_record_with_id(b'{"conversation_id": 12, "messages": []}')[1] == "12"
    assert parse_record_with_id(b'{"messages": [], "id": true}')[1] is None
    record, record_id = parse_record_with_id(b'{"id": "cut-7", "messages": [{"role": "us')
    assert record_id == "cut-7" and getattr(record, "reason", None) == "malformed_json"
