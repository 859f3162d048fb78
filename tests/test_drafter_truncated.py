"""``scripts/device/drafter/truncated.py`` (the drafter proof's "prefix cache on" rows) end to end on CPU:
the features it writes are checked against the hsx job whose token ids and loss masks it reads.

Real parts: an hsx job over a few chats that share a system prompt (the API in process, Redis, a SQLite job
table, a burst worker process and the session's reference engine with the prefix cache off); a second
reference engine with the prefix cache on, in bf16 as SGLang serves the proof's target; the script itself
as a subprocess, one request at a time, so that the first sample is the one with nothing cached.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy.typing as npt
import pytest
import torch

from tests.conftest import REDIS_URL
from tests.fixtures.engine import _spawn, _stop, _wait_healthy, engine_url
from tests.fixtures.stack import REPO, make_stack

SCRIPT = REPO / "scripts" / "device" / "drafter" / "truncated.py"
SYSTEM = "You are a patient cooking teacher. Answer briefly and name one tip."
# Single turns under one system prompt, and a second turn that repeats the first chat's whole first turn: its
# cached prefix then ends inside the conversation, past an assistant turn that is in the loss.
TURNS = [
    ("How long should I boil an egg?", "About nine minutes for a firm yolk. Tip: cool it in cold water."),
    ("Why does bread dough need to rest?", "Resting lets the gluten relax. Tip: cover it with a cloth."),
    ("What makes rice sticky?", "Starch on the grains. Tip: rinse the rice until the water is clear."),
    ("Can I freeze fresh basil?", "Yes, chopped in olive oil. Tip: use an ice cube tray."),
]
SECOND_TURN = ("And a soft yolk?", "About six minutes. Tip: start the timer when the water boils again.")
MIN_COSINE = 0.99


def _chats() -> list[list[dict[str, str]]]:
    def turn(user: str, assistant: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]

    system = [{"role": "system", "content": SYSTEM}]
    chats = [system + turn(*pair) for pair in TURNS]
    chats.append(chats[0] + turn(*SECOND_TURN))
    return chats


def _script_module() -> ModuleType:
    """truncated.py as a module (not a package's), for its layer constants."""
    spec = importlib.util.spec_from_file_location("drafter_truncated", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def job_output(engine_nocache: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished hsx job over the chats, captured with the prefix cache off."""
    from hsx.server.db.migrate import upgrade
    from hsx.server.settings import get_settings

    tmp = tmp_path_factory.mktemp("truncated-job")
    dataset = tmp / "chats.jsonl"
    dataset.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in _chats()))
    db_url = f"sqlite:///{tmp / 'hsx.sqlite3'}"
    upgrade(db_url)
    with pytest.MonkeyPatch.context() as patch:
        stack = make_stack(db_url, REDIS_URL, engine_nocache.url, tmp, patch)
        try:
            job = stack.submit(dataset, samples_per_shard=4)
            assert stack.run_burst(timeout=300) == 0, stack.logs()
            doc = stack.wait(job["id"], timeout=120)
            assert doc["state"] == "succeeded", (doc, stack.logs())
            assert doc["progress"]["samples_done"] == len(_chats()), doc["progress"]
        finally:
            stack.stop_workers()
            get_settings.cache_clear()
    return Path(doc["output_dir"])


@pytest.fixture(scope="module")
def bf16_cache_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A reference engine with the prefix cache on (no --disable-prefix-cache), bf16, its own dump dir."""
    workdir = tmp_path_factory.mktemp("truncated-engine")
    process, port_file, dump_dir, log_path = _spawn(model_dir, workdir, "cache-bf16", ["--dtype", "bfloat16"])
    try:
        url = engine_url(process, port_file, log_path)
        _wait_healthy(process, url, log_path)
        yield url, dump_dir
    finally:
        _stop(process)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    return next((p for p, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _cosines(got: torch.Tensor, want: npt.NDArray[Any]) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(got.float(), torch.from_numpy(want).float(), dim=-1)


def test_truncated_features_sit_at_their_true_positions_only_in_the_aligned_folder(
    job_output: Path, bf16_cache_engine: tuple[str, str], tmp_path: Path
) -> None:
    from hsx.engine.client import EngineClient
    from hsx.loader import OutputReader

    url, dump_dir = bf16_cache_engine
    client = EngineClient(url, timeout=60.0, retries=0)
    try:
        info = client.info()
    finally:
        client.close()
    script = _script_module()
    # The script's layers are the EAGLE-3 default for SmolLM2's 30 layers: what the engine captures.
    assert info.prefix_cache and info.num_layers == 30 and info.dtype == "bfloat16", info
    assert [*script.AUX_HF, script.FINAL_HF] == info.hf_indices

    job = list(OutputReader(job_output))
    assert len(job) == len(_chats())
    out_root = tmp_path / "features"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), url, dump_dir, str(job_output), str(out_root), "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert json.loads((out_root / "summary.json").read_text()) == summary

    # What the engine's prefix cache must reuse, from the job's own ids: in order, the longest prefix shared
    # with an earlier sample, always leaving one token to compute.
    ids = [s.input_ids.tolist() for s in job]
    expected_cached = [
        min(max((_shared_prefix(earlier, mine) for earlier in ids[:i]), default=0), len(mine) - 1)
        for i, mine in enumerate(ids)
    ]
    assert expected_cached[0] == 0 and all(c > 0 for c in expected_cached[1:]), expected_cached
    tokens = sum(len(mine) for mine in ids)
    assert summary == {
        "samples": len(job),
        "truncated": len(job) - 1,
        "cached_mean": round(sum(expected_cached) / len(job), 1),
        "cached_max": max(expected_cached),
        "tokens_sent": tokens,
        "rows_dumped": tokens - sum(expected_cached),
    }, (summary, expected_cached)
    # The second turn of the first chat reuses that chat's whole first exchange, loss tokens included.
    assert job[-1].loss_mask[: expected_cached[-1]].sum() > 0

    hidden = info.hidden_size
    for i, (sample, cached) in enumerate(zip(job, expected_cached, strict=True)):
        rows = len(sample.input_ids) - cached
        assert sample.hidden_state is not None  # the reference engine captures the post-norm final state
        files = {
            name: next((out_root / name).glob(f"rows_*/data_{i}.ckpt")) for name in ("misaligned", "aligned")
        }
        misaligned, aligned = (torch.load(files[name]) for name in ("misaligned", "aligned"))
        for saved in (misaligned, aligned):
            assert set(saved) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
            assert saved["hidden_state"].shape == (1, rows, hidden)
            assert saved["aux_hidden_state"].shape == (1, rows, 3 * hidden)
            assert len(saved["input_ids"]) == len(saved["loss_mask"]) == rows
        # The same dumped rows in both folders; only the tokens they are paired with differ.
        assert torch.equal(misaligned["hidden_state"], aligned["hidden_state"])
        assert misaligned["input_ids"].tolist() == sample.input_ids[:rows].tolist()
        assert misaligned["loss_mask"].tolist() == sample.loss_mask[:rows].tolist()
        assert aligned["input_ids"].tolist() == sample.input_ids[cached:].tolist()
        assert aligned["loss_mask"].tolist() == sample.loss_mask[cached:].tolist()

        # The dumped rows are the job's own states at positions cached..T, final and aux alike.
        final = _cosines(aligned["hidden_state"][0], sample.hidden_state[cached:])
        aux = _cosines(
            aligned["aux_hidden_state"][0].reshape(rows, 3, hidden),
            sample.aux_hidden_state[cached:].reshape(rows, 3, hidden),
        )
        assert final.min().item() > MIN_COSINE, (i, cached, final.min().item())
        assert aux.min().item() > MIN_COSINE, (i, cached, aux.min().item())
        # ... and not the job's states at the positions the misaligned folder pairs them with.
        shifted = _cosines(misaligned["hidden_state"][0], sample.hidden_state[:rows]).mean().item()
        if cached:
            assert shifted < MIN_COSINE - 0.1, (i, cached, shifted)
