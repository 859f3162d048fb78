"""``hsx jobs`` on a normal terminal and in a pipe: the id and the state always show whole, each line fits
the width, and a long dataset path is the one shortened, in the middle, keeping its file's name."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console

from hsx.cli.job_tables import jobs_table, shorten_middle
from tests.fixtures.live_server import serve_in_thread
from tests.fixtures.stack import REPO, Stack

SAMPLE = REPO / "tests" / "data" / "short_chats.jsonl"
LONG_PATH = "/home/someone/projects/eagle/datasets/ultrachat_200k/train_sft_part_0001_of_0040.jsonl"
postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)

PAGE: dict[str, Any] = {
    "total": 2,
    "items": [
        {
            "id": "3f2a9c1e-1b2c-4d5e-8f90-a1b2c3d4e5f6",
            "state": "running",
            "created_at": "2026-12-05T07:55:00.123456+00:00",
            "dataset_uri": LONG_PATH,
            "progress": {
                "fraction": 0.57,
                "samples_done": 11400,
                "samples_total": 20000,
                "samples_rejected": 12,
                "tokens_per_second": 7123.4,
            },
        },
        {
            "id": "0c1d2e3f-4a5b-4c6d-9e7f-809a1b2c3d4e",
            "state": "succeeded",
            "created_at": "2026-12-04T07:55:00+00:00",
            "dataset_uri": "/data/a.jsonl",
            "progress": {"fraction": 1.0, "samples_done": 14, "samples_total": 14, "samples_rejected": 0},
        },
    ],
}


def rendered(width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width).print(jobs_table(PAGE, width))
    return out.getvalue().splitlines()


def row_of(lines: list[str], job_id: str) -> str:
    return next(line for line in lines if job_id in line)


@pytest.mark.parametrize("width", [80, 120])
def test_id_and_state_show_whole_and_the_long_path_gives_way(width: int) -> None:
    lines = rendered(width)
    assert all(cell_len(line) <= width for line in lines), lines
    header = lines[1].split()
    assert header[:4] == ["job", "state", "done", "samples"] and header[-1] == "dataset", lines
    for job in PAGE["items"]:
        row = row_of(lines, job["id"]).split()
        assert row[:2] == [job["id"], job["state"]], lines
    running = row_of(lines, PAGE["items"][0]["id"])
    assert "57%" in running and "11400/20000" in running, lines
    shown = running.split()[-1]
    assert (
        "…" in shown and LONG_PATH.endswith(shown.split("…")[1]) and LONG_PATH.startswith(shown.split("…")[0])
    )
    assert shown.endswith(".jsonl"), shown


def test_a_wider_terminal_shows_more_columns_and_more_of_the_path() -> None:
    narrow, wide, wider = rendered(80), rendered(120), rendered(200)
    assert "rejected" not in narrow[1] and "rejected" in wide[1], (narrow, wide)
    running = PAGE["items"][0]["id"]
    assert len(row_of(wide, running).split()[-1]) > len(row_of(narrow, running).split()[-1])
    # With room for all of it, nothing is shortened and every column shows.
    assert wider[1].split() == ["job", "state", "done", "samples", "rejected", "tok/s", "created", "dataset"]
    assert row_of(wider, running).split()[-1] == LONG_PATH
    assert "7,123.4" in row_of(wider, running) and "2026-12-05 07:55:00" in row_of(wider, running)


def test_shorten_middle_keeps_both_ends_within_the_width() -> None:
    assert shorten_middle("/data/a.jsonl", 40) == "/data/a.jsonl"
    for width in (1, 2, 5, 12, 30):
        short = shorten_middle(LONG_PATH, width)
        assert cell_len(short) == width and "…" in short, short
    # Wide characters count two cells each.
    assert shorten_middle("/データ/とても長い名前のファイル.jsonl", 12) == "/デ…ル.jsonl"


@postgres_only
def test_hsx_jobs_in_a_pipe_fits_80_columns_or_what_columns_says(synthetic_stack: Stack) -> None:
    stack = synthetic_stack
    deep = stack.tmp.joinpath(*["a-rather-long-folder-name"] * 4)
    deep.mkdir(parents=True)
    dataset = deep / "chats_with_a_long_descriptive_name.jsonl"
    shutil.copy(SAMPLE, dataset)
    job = stack.submit(dataset)
    with serve_in_thread(stack.client.app) as api_url:
        for columns, width in ((None, 80), ("120", 120)):
            env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
            env.update(stack.env, PYTHONPATH=str(REPO), **({"COLUMNS": columns} if columns else {}))
            done = subprocess.run(
                [sys.executable, "-m", "hsx.cli", "jobs", "--api-url", api_url],
                env=env,
                cwd=Path(REPO),
                capture_output=True,  # stdout is a pipe, as in `hsx jobs | head`
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done
            lines = done.stdout.splitlines()
            assert all(cell_len(line) <= width for line in lines), (width, lines)
            row = row_of(lines, job["id"]).split()
            assert row[:2] == [job["id"], "queued"], lines
            head, tail = row[-1].split("…")
            assert str(dataset).startswith(head) and str(dataset).endswith(tail), lines
            assert len(tail) > len(head) and tail.endswith(".jsonl"), lines
            assert ("rejected" in lines[1]) is (width == 120), lines
