"""Soak: one job of 2,000 samples in 40 units, two workers, ten random kills (horses and whole workers, the
whole workers replaced); every sample must end exactly once, read back from every shard.

The CPU reference engine takes about half a second a prefill on this machine, so 2,000 engine-bound samples
would take a quarter of an hour: four samples of each unit are real conversations (160 go through the
engine) and the others are records the pipeline must reject, each with its reason. Every unit commits a
shard and rejections together, which is what a duplicate or a loss would break.
"""

from __future__ import annotations

import functools
import json
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_faults import (
    all_gone,
    assert_exactly_once,
    children,
    fast_stack,
    live_lease,
    owner_pid,
    running,
    signal_groups,
    units,
    wait_until,
)

TOTAL = 2000
PER_SHARD = 50
REAL = (0, 13, 26, 39)  # positions in each unit of the conversations that reach the engine
KILLS = 10
WHOLE_WORKER_KILLS = {2, 5, 8}  # these kills take the whole worker (then replaced), the others its horse


def write_soak_dataset(path: Path) -> Path:
    bad = [
        '{"messages": [{"role": "user", "content": "cut',  # not JSON
        json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
        json.dumps({"messages": []}),
        json.dumps(
            {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}
        ),
        json.dumps([1, 2, 3]),
        json.dumps({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]}),
    ]
    with path.open("w", encoding="utf-8") as fh:
        for i in range(TOTAL):
            if i % PER_SHARD in REAL:
                messages = [
                    {"role": "user", "content": f"Soak {i}: spell {i}."},
                    {"role": "assistant", "content": " ".join(str(i))},
                ]
                fh.write(json.dumps({"messages": messages}) + "\n")
            else:
                fh.write(bad[i % len(bad)] + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_soak_two_thousand_samples_ten_kills_nothing_lost_or_doubled(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.ingest import SampleError
    from tests.reference_samples import iter_samples

    dataset = write_soak_dataset(tmp_path / "soak.jsonl")
    expected_rejections = {
        i: raw.reason for i, raw in iter_samples(dataset, 0, TOTAL) if isinstance(raw, SampleError)
    }
    real = {i for i in range(TOTAL) if i % PER_SHARD in REAL}
    assert set(expected_rejections) == set(range(TOTAL)) - real
    rng = random.Random(20240601)
    with running(fast_stack(db_url, redis_url, engine_nocache, tmp_path, monkeypatch)) as s:
        workers = [s.start_worker(), s.start_worker()]
        job_id = str(s.submit(dataset, samples_per_shard=PER_SHARD)["id"])
        kills: list[tuple[str, int, int]] = []
        while len(kills) < KILLS:
            time.sleep(rng.uniform(0.5, 3.0))
            held = wait_until(lambda: live_lease(db_url, job_id), 120, "a unit in progress", s)
            horse = owner_pid(held["owner"])
            worker = next((w for w in workers if horse in children(w.pid)), None)
            whole = worker is not None and len(kills) in WHOLE_WORKER_KILLS  # else only the horse
            groups = {horse, *([worker.pid] if whole and worker is not None else [])}
            signal_groups(groups, signal.SIGSTOP)
            now = units(db_url, job_id)[held["index"]]
            if (now["state"], now["attempt"], now["owner"]) != ("leased", held["attempt"], held["owner"]):
                signal_groups(groups, signal.SIGCONT)  # it committed meanwhile: pick another moment
                continue
            signal_groups(groups, signal.SIGKILL)
            wait_until(functools.partial(all_gone, groups), 30, "the killed processes to go")
            if whole and worker is not None:
                worker.wait(30)
                workers = [w for w in workers if w is not worker] + [s.start_worker()]
            kills.append(("worker" if whole else "horse", held["index"], held["attempt"]))
        doc = s.wait(job_id, timeout=300)
        out = assert_exactly_once(s, doc, TOTAL)
    assert out.rejected == expected_rejections
    assert set(out.samples) == real
    for index, (ids, mask, final, aux) in out.samples.items():
        assert len(ids) == len(mask) == final.shape[0] == aux.shape[0] > 0, index
        assert mask.sum() > 0 and np.isfinite(final).all() and np.isfinite(aux).all(), index
    attempts = {u["index"]: u["attempt"] for u in units(db_url, job_id)}
    assert len(kills) == KILLS and sum(kind == "worker" for kind, *_ in kills) == len(WHOLE_WORKER_KILLS)
    for _kind, index, attempt in kills:  # each interrupted unit was redone by a later attempt
        assert attempts[index] > attempt, (index, attempt, attempts[index])
