"""End to end: API, Redis queue, job table (PostgreSQL and SQLite), real worker processes, real engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.stack import REPO, Stack, make_stack

# Short conversations, several sharing a system prompt: the CPU engine is slow on a 2-core machine, and the
# shared prefixes are what make the cache-on engine truncate.
SAMPLE = REPO / "tests" / "data" / "short_chats.jsonl"
MAX_LEN = 4096
postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
BAD = REPO / "data" / "bad_chats.jsonl"


def count_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def read_back(doc: dict[str, Any]) -> list[Any]:
    from hsx.loader import iter_samples

    return list(iter_samples(doc["output_dir"]))


def test_job_runs_end_to_end(stack: Stack) -> None:
    job = stack.submit(SAMPLE, samples_per_shard=4)
    assert job["state"] == "queued"
    assert stack.run_burst() == 0, stack.logs()
    doc = stack.wait(job["id"], timeout=60)
    assert doc["state"] == "succeeded", (doc, stack.logs())
    total = count_lines(SAMPLE)
    progress = doc["progress"]
    assert progress["samples_total"] == total
    # Every record of the sample is valid and the engine has no prefix cache: nothing may be rejected.
    assert (progress["samples_done"], progress["samples_rejected"]) == (total, 0), progress
    assert progress["tokens"] > 0
    assert progress["tokens_per_second"] > 0
    assert doc["output"]["uri"] is None  # no HSX_OUTPUT_URI: the output stays in output_dir
    samples = read_back(doc)
    assert stack.client.get(f"/jobs/{job['id']}/rejections").json()["items"] == []
    assert sorted(s.index for s in samples) == list(range(total))
    for s in samples:
        assert s.hidden_state.shape[0] == len(s.input_ids) == s.aux_hidden_state.shape[0] == len(s.loss_mask)
        assert s.aux_hidden_state.shape[1] == 3 * s.hidden_state.shape[1]
        assert s.loss_mask.sum() > 0
        assert np.isfinite(s.hidden_state).all()
    assert sum(len(s.input_ids) for s in samples) == progress["tokens"]
    shards = stack.client.get(f"/jobs/{job['id']}/shards").json()
    assert shards["total"] == doc["shards"]["total"] == len(shards["items"]) == -(-total // 4)
    manifest = json.loads(Path(doc["manifest"]).read_text())
    assert manifest["counts"]["samples"] == progress["samples_done"]
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in shards["items"]]


def test_bad_records_are_rejected_with_reasons(stack: Stack) -> None:
    job = stack.submit(BAD, samples_per_shard=4)
    assert stack.run_burst() == 0, stack.logs()
    doc = stack.wait(job["id"], timeout=60)
    assert doc["state"] == "succeeded", doc
    rejections = stack.client.get(f"/jobs/{job['id']}/rejections").json()
    assert rejections["total"] == doc["progress"]["samples_rejected"] > 0
    reasons = {r["reason"] for r in rejections["items"]}
    assert {"malformed_json", "no_assistant_turn"} <= reasons, reasons
    assert all(r["detail"] for r in rejections["items"])
    done = {s.index for s in read_back(doc)}
    assert done.isdisjoint(r["sample_index"] for r in rejections["items"])
    assert len(done) + rejections["total"] == count_lines(BAD)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"dataset_uri": "/etc/passwd"}, "path_outside_roots"),
        ({"dataset_uri": "data/../../../etc/passwd"}, "path_traversal"),
        ({"dataset_uri": "ftp://example.com/x.jsonl"}, "uri_scheme_not_allowed"),
        ({"dataset_uri": str(SAMPLE), "options": {"max_length": 1}}, "invalid_request"),
        ({"dataset_uri": str(SAMPLE), "options": {"aux_layers": [3, 3]}}, "invalid_request"),
        ({"dataset_uri": str(SAMPLE), "surprise": 1}, "invalid_request"),
    ],
)
@postgres_only
def test_invalid_submissions_are_refused_and_nothing_is_queued(
    stack: Stack, body: dict[str, Any], code: str
) -> None:
    resp = stack.client.post("/jobs", json=body)
    assert 400 <= resp.status_code < 500, resp.text
    assert resp.json()["error"] == code, resp.json()
    assert resp.json()["detail"]
    assert stack.client.get("/jobs").json()["total"] == 0
    from hsx.server.jobs.queue import queue_for

    assert queue_for(stack.settings).count == 0


@postgres_only
def test_empty_dataset_is_refused(stack: Stack) -> None:
    empty = stack.tmp / "empty.jsonl"
    empty.write_text("\n\n")
    resp = stack.client.post("/jobs", json={"dataset_uri": str(empty)})
    assert resp.status_code == 400 and resp.json()["error"].startswith("dataset_"), resp.text


@postgres_only
def test_idempotency_key_cancel_and_listing(stack: Stack) -> None:
    first = stack.client.post("/jobs", json={"dataset_uri": str(SAMPLE)}, headers={"Idempotency-Key": "k-1"})
    again = stack.client.post("/jobs", json={"dataset_uri": str(SAMPLE)}, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    other = stack.client.post(
        "/jobs",
        json={"dataset_uri": str(SAMPLE), "options": {"max_length": 64}},
        headers={"Idempotency-Key": "k-1"},
    )
    assert other.status_code == 409 and other.json()["error"] == "idempotency_key_reused"
    job_id = first.json()["id"]
    cancelled = stack.client.post(f"/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert stack.client.post(f"/jobs/{job_id}/cancel").status_code == 409
    assert stack.client.get("/jobs", params={"state": "cancelled"}).json()["total"] == 1
    assert stack.client.get("/jobs", params={"state": "running"}).json()["total"] == 0
    assert stack.client.get("/jobs/nope").status_code == 404
    assert stack.run_burst() == 0
    assert stack.job(job_id)["state"] == "cancelled"
    assert stack.job(job_id)["progress"]["samples_done"] == 0


@postgres_only
def test_preflight_refuses_a_prefix_caching_engine(
    db_url: str, redis_url: str, engine_cache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a fleet the submission is queued for engines that may join (alone, POST /jobs refuses it: see
    # test_api_usability). The only engine is unfit: with no time granted to wait, the job fails at once.
    s = make_stack(
        db_url,
        redis_url,
        engine_cache.url,
        tmp_path,
        monkeypatch,
        no_fit_engine_seconds="0",
        engine_fleet="true",
    )
    job = s.submit(SAMPLE)
    assert "fleet" in job["engine_wait"] and "0s" in job["engine_wait"], job["engine_wait"]
    assert s.run_burst() == 0, s.logs()
    doc = s.wait(job["id"], timeout=30)
    assert doc["state"] == "failed"
    assert doc["error"].startswith("no fit engine"), doc["error"]
    assert "prefix cache is on" in doc["error"], doc["error"]
    assert doc["engines"][0]["state"] == "unfit" and doc["progress"]["units_total"] == 0
    assert doc["progress"]["samples_done"] == 0 and doc["shards"]["total"] == 0
    s.start_worker()  # /verify runs on a worker (it reads the dumps)
    try:
        verify = s.client.post("/verify")
    finally:
        s.stop_workers()
    assert verify.status_code == 503 and not verify.json()["ok"]
    assert any("cached_tokens" in c["name"] and not c["ok"] for c in verify.json()["checks"])


@postgres_only
def test_truncated_states_never_reach_a_shard_when_preflight_is_bypassed(
    db_url: str, redis_url: str, engine_cache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache-on engine really truncates prompts that share a prefix; validation must catch every one."""
    from hsx.server.settings import get_settings
    from tests.fixtures.unchecked_runner import UncheckedRunner

    s = make_stack(db_url, redis_url, engine_cache.url, tmp_path, monkeypatch, engine_fleet="true")
    job = s.submit(SAMPLE, samples_per_shard=32, cache_namespace_per_request=False)
    runner = UncheckedRunner(job["id"], get_settings())
    while runner.run(max_units=1).more_work:
        pass
    doc = s.job(job["id"])
    assert doc["state"] == "succeeded", doc
    rejections = s.client.get(f"/jobs/{job['id']}/rejections").json()["items"]
    cached = [r for r in rejections if r["reason"] == "cached_tokens"]
    # Conversations in the sample set share a long system prompt, so the cache must have hit.
    assert cached, rejections
    assert all("cached" in r["detail"] for r in cached)
    samples = read_back(doc)
    assert samples, "the first prompt of each prefix group has nothing cached and must be kept"
    from transformers import AutoTokenizer

    from tests.reference_samples import iter_samples
    from workers.chat import ChatEncoder

    encoder = ChatEncoder(AutoTokenizer.from_pretrained(doc["engine"]["model_path"]), True, MAX_LEN)
    expected = {
        i: encoder.encode(m).input_ids for i, m in iter_samples(SAMPLE, 0, 10**6) if isinstance(m, list)
    }
    for sample in samples:
        assert sample.input_ids.tolist() == expected[sample.index]
        assert sample.hidden_state.shape[0] == len(expected[sample.index])


@postgres_only
def test_captured_states_match_a_direct_transformers_forward(stack: Stack) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    job = stack.submit(SAMPLE, samples_per_shard=4)
    assert stack.run_burst() == 0, stack.logs()
    doc = stack.wait(job["id"], timeout=60)
    engine = doc["engine"]
    model = AutoModelForCausalLM.from_pretrained(engine["model_path"], dtype=torch.float32).eval()
    aux_idx, final_idx = engine["hf_indices"][:-1], engine["hf_indices"][-1]
    samples = read_back(doc)[:4]
    assert len(samples) == 4
    for sample in samples:
        with torch.no_grad():
            out = model(torch.tensor([sample.input_ids.tolist()]), output_hidden_states=True)
        ref_aux = torch.cat([out.hidden_states[i][0] for i in aux_idx], dim=-1)
        ref_final = out.hidden_states[final_idx][0]
        h = ref_final.shape[-1]
        for k, i in enumerate(aux_idx):
            got = torch.from_numpy(np.ascontiguousarray(sample.aux_hidden_state[:, k * h : (k + 1) * h]))
            cos = torch.nn.functional.cosine_similarity(got.float(), ref_aux[:, k * h : (k + 1) * h], dim=-1)
            assert cos.min().item() >= 0.999, (i, cos.min().item())
        cos = torch.nn.functional.cosine_similarity(
            torch.from_numpy(sample.hidden_state).float(), ref_final, dim=-1
        )
        assert cos.min().item() >= 0.999


def test_the_api_never_imports_torch() -> None:
    code = "import sys, app.main; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
