"""Soak: one job of 2,000 samples in 40 units, two workers, ten kills spread over the job (horses and whole
workers, the whole workers replaced), each at a moment the test has observed and frozen (the killed horse
holds a unit's lease and has no transaction open); every sample must end exactly once, read back from every
shard.

The CPU reference engine takes about half a second a prefill on this machine, so 2,000 engine-bound samples
would take a quarter of an hour: two samples of each unit are real conversations (80 go through the
engine) and the others are records the pipeline must reject, each with its reason. Every unit commits a
shard and rejections together, which is what a duplicate or a loss would break.

The engine-served samples must equal an uninterrupted run's, array for array. The 80 real conversations
cycle through 16 texts, so the uninterrupted run (in process, no kills) needs 16 prefills, not 80; their
input ids still differ from each of their unit neighbours'.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.kills import end_unit_lease, freeze_holding_a_lease, owner_pid, units
from tests.fixtures.processes import children, signal_pids, wait_gone
from tests.test_faults import assert_exactly_once, fast_stack, running, uninterrupted_output, wait_until

TOTAL = 2000
PER_SHARD = 50
REAL = (0, 26)  # positions in each unit of the conversations that reach the engine
CONVERSATIONS = 16  # distinct real conversations, cycled through the real positions
KILLS = 10  # spread over the job by the units done before each
WHOLE_WORKER_KILLS = {2, 5, 8}  # these kills take the whole worker (then replaced), the others its horse


def conversation(number: int) -> str:
    messages = [
        {"role": "user", "content": f"Soak {number}: spell {number}."},
        {"role": "assistant", "content": " ".join(str(number))},
    ]
    return json.dumps({"messages": messages})


def conversation_of(index: int) -> int:
    """Which of the distinct conversations the real sample at ``index`` is."""
    return (index // PER_SHARD * len(REAL) + REAL.index(index % PER_SHARD)) % CONVERSATIONS


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
                fh.write(conversation(conversation_of(i)) + "\n")
            else:
                fh.write(bad[i % len(bad)] + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_soak_two_thousand_samples_ten_kills_nothing_lost_or_doubled(
    db_url: str, redis_url: str, engine_nocache: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hsx.server.ingest import SampleError
    from tests.reference_samples import iter_samples

    dataset = write_soak_dataset(tmp_path / "soak.jsonl")
    expected_rejections = {
        i: raw.reason for i, raw in iter_samples(dataset, 0, TOTAL) if isinstance(raw, SampleError)
    }
    real = {i for i in range(TOTAL) if i % PER_SHARD in REAL}
    assert set(expected_rejections) == set(range(TOTAL)) - real
    with running(fast_stack(db_url, redis_url, engine_nocache, tmp_path, monkeypatch)) as s:
        workers = [s.start_worker(), s.start_worker()]
        job_id = str(s.submit(dataset, samples_per_shard=PER_SHARD)["id"])
        kills: list[tuple[str, int, int]] = []
        for number in range(KILLS):
            whole = number in WHOLE_WORKER_KILLS  # else only the horse
            # Spread over the job: the kill comes at the first unit held once this many units are done.
            units_done = number * (TOTAL // PER_SHARD) // KILLS
            wait_until(
                lambda done=units_done: s.job(job_id)["progress"]["units_done"] >= done, 300, "the units", s
            )

            def pick(unit: dict[str, Any], whole: bool = whole) -> set[int] | None:
                horse = owner_pid(unit["owner"])
                worker = next((w for w in workers if horse in children(w.pid)), None)
                if worker is None:
                    return None
                return {worker.pid} if whole else {horse}  # a worker stands for its session, horse included

            held, frozen = freeze_holding_a_lease(db_url, job_id, pick, describe=s.logs)
            signal_pids(frozen, signal.SIGKILL)
            wait_gone(frozen)
            if whole:
                killed = next(w for w in workers if w.pid in frozen)
                killed.wait(30)
                # Nobody is left to renew or release its lease: its time passes (the test says when).
                end_unit_lease(db_url, held)
                workers.remove(killed)
                workers.append(s.start_worker())
            kills.append(("worker" if whole else "horse", held["index"], held["attempt"]))
        doc = s.wait(job_id, timeout=300)
        out = assert_exactly_once(s, doc, TOTAL)
    assert out.rejected == expected_rejections
    assert set(out.samples) == real
    # Each engine-served sample equals the uninterrupted run's output of its conversation.
    reference = tmp_path / "uninterrupted"
    reference.mkdir()
    texts = reference / "conversations.jsonl"
    texts.write_text("".join(conversation(n) + "\n" for n in range(CONVERSATIONS)), encoding="utf-8")
    want = uninterrupted_output(engine_nocache, reference, texts, CONVERSATIONS, CONVERSATIONS)
    assert sorted(want.samples) == list(range(CONVERSATIONS)) and not want.rejected
    for index, arrays in out.samples.items():
        expected = want.samples[conversation_of(index)]
        for name, got, ref in zip(
            ("input_ids", "loss_mask", "hidden_state", "aux"), arrays, expected, strict=True
        ):
            assert got.shape == ref.shape and np.array_equal(got, ref), f"sample {index}: {name} differs"
    attempts = {u["index"]: u["attempt"] for u in units(db_url, job_id)}
    assert len(kills) == KILLS and sum(kind == "worker" for kind, *_ in kills) == len(WHOLE_WORKER_KILLS)
    for _kind, index, attempt in kills:  # each interrupted unit was redone by a later attempt
        assert attempts[index] > attempt, (index, attempt, attempts[index])
