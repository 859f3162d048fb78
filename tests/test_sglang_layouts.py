"""The SGLang plugin under SGLang's parallel layouts, on CPU: four processes over gloo lay a small MoE
decoder out as SGLang 0.5.17 lays out DeepSeek-V3 (tests/sglang_layouts/standin.py: row-parallel layers
with an all-reduce, tokens split by ``tensor_split``, DP-attention groups each with its own requests,
gathered and scattered around the MoE), enter the plugin as SGLang's schedulers would, and serve chunked
batches (tests/sglang_layouts/harness.py). Every layout ends in dumps with the rows and values of an
unsharded forward of each request, or in a refusal that names the reason; the layouts run once, in one
module-scoped spawn, and each test reads its part of the outcome.

Where the refusals come from, and why each is needed: the ``-bypass`` layouts install the capture where
SGLang would put it without the refusals and show what would happen (PP: every capture dropped; an
all-to-all backend at attention TP 2: the model's own scatter modes refuse it, and without that check too
multi-token captures are dropped, never written wrong).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx import contract
from tests.fixtures.shared import once_per_session
from tests.sglang_layouts.harness import LAYOUTS, WORLD, Layout, server_args
from tests.sglang_layouts.standin import LAYERS, reference_states
from tests.sglang_layouts.workload import group_requests
from workers.engines.sglang.layouts import parallel_layout

REPO = Path(__file__).resolve().parents[1]
BY_NAME = {layout.name: layout for layout in LAYOUTS}

# layout -> the ranks that capture (each DP group's first rank; each replica's TP rank 0)
CAPTURED = {
    "tp4": {0},
    "tp4-ep4": {0},
    "dp2-replicas-tp2": {0, 2},
    "tp4-dp4-dpattn": {0, 1, 2, 3},
    "tp4-dp4-dpattn-deepep-densetp1": {0, 1, 2, 3},  # the usual Kimi layout: attention TP 1, DeepEP
    "tp4-dp2-dpattn": {0, 2},
    "tp4-dp2-dpattn-densetp1": {0, 2},  # dense layer scattered, but no aux layer on it
    "tp4-2nodes": {0},
    "tp4-dp4-dpattn-2nodes-shared": {0, 1, 2, 3},
}
ALL = (0, 1, 2, 3)
# layout -> {rank: words of its refusal}; every other rank starts, and the server stops with the refusing one
REFUSED = {
    "tp4-deepep": dict.fromkeys(ALL, "'deepep' (--moe-a2a-backend) with attention TP 4"),
    "tp4-dp2-dpattn-deepep": dict.fromkeys(ALL, "'deepep' (--moe-a2a-backend) with attention TP 2"),
    "tp4-dp2-dpattn-deepep-bypass": dict.fromkeys((0, 2), "layers [1, 2, 3] leave their output SCATTERED"),
    "tp4-dp2-dpattn-densetp1-dense-aux": dict.fromkeys((0, 2), "layers [0] leave their output SCATTERED"),
    "pp2-tp2": dict.fromkeys(ALL, "the decoder layers live on different stages"),
    "tp4-dp4-dpattn-2nodes": dict.fromkeys(ALL, "DP attention over 2 nodes"),
    "tp4-2nodes-mismatch": {
        0: "node 1 (rank 2) runs with other flags: hsx_final_state: 'pre' there, 'post' here",
        2: "node 0 runs with other flags than node 1: hsx_final_state: 'post' there, 'pre' here",
        3: "node 0 runs with other flags than node 1",
    },
    "tp4-2nodes-plain-node1": {0: "ranks [2, 3] (node(s) [1]) did not say within 0.5 s how they run"},
}


@dataclass
class Run:
    out: Path
    ranks: list[dict[str, Any]]  # per rank: layout name -> what happened
    log: str


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The harness's run of every layout: once per session, whichever test process asks first
    (tests/fixtures/shared.py)."""
    return once_per_session(tmp_path_factory, "sglang-layouts", run_layouts)


def run_layouts(out: Path) -> Run:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sglang_layouts.harness", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the ranks it forks share its process group
    )
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the layout run hung:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return Run(out, ranks, log)


def groups_of(layout: Layout) -> int:
    """How many request queues the layout has: DP-attention groups, or replicas."""
    return int(server_args(layout, 0).dp_size)


def expected_dumps(layout: Layout) -> dict[str, tuple[int, list[int]]]:
    """Every captured rid of the layout: the group that served it, and its prompt."""
    return {
        r.rid: (g, r.origin_input_ids)
        for g, reqs in enumerate(group_requests(layout.name, groups_of(layout)))
        for r in reqs
        if contract.is_captured_rid(r.rid)
    }


def read_dump(directory: Path) -> tuple[contract.DumpMeta, dict[str, torch.Tensor]]:
    meta = contract.DumpMeta.from_json((directory / contract.META_FILE).read_text())
    raw = contract.read_safetensors(str(directory / contract.STATES_FILE))
    tensors = {
        name: torch.frombuffer(bytearray(t.data), dtype=torch.int32 if t.dtype == "I32" else torch.float32)
        .view(*t.shape)
        .clone()
        for name, t in raw.items()
    }
    return meta, tensors


def assert_matches_an_unsharded_forward(layout: Layout, directory: Path, prompt: list[int]) -> None:
    meta, tensors = read_dump(directory)
    want = reference_states(tuple(prompt))
    hf = [a + 1 for a in layout.aux] + [LAYERS]
    assert meta.num_tokens == len(prompt) and meta.hf_indices == hf
    assert tensors["input_ids"].tolist() == prompt
    for index in hf:
        name = contract.tensor_name(index)
        # the same rows; the same values up to the order of the sharded sums
        torch.testing.assert_close(
            tensors[name], want[name], rtol=1e-5, atol=1e-5, msg=f"{directory.name} {name}"
        )


def dump_dirs(run: Run, name: str) -> list[Path]:
    root = run.out / name
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_each_dp_groups_leader_captures_its_own_requests(run: Run, name: str) -> None:
    outcome = [r[name] for r in run.ranks]
    assert all(o["refused"] is None and o["served"] for o in outcome), outcome
    assert {rank for rank, o in enumerate(outcome) if o["capture"]} == CAPTURED[name]
    for rank in CAPTURED[name]:
        assert outcome[rank]["errors"] == 0 and outcome[rank]["dropped"] == 0, outcome[rank]


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_each_layout_writes_the_rows_and_values_of_an_unsharded_forward(run: Run, name: str) -> None:
    layout = BY_NAME[name]
    want = expected_dumps(layout)
    assert [p.name for p in dump_dirs(run, name)] == sorted(want)  # every captured rid, no plain one
    dp = server_args(layout, 0).dp_size > 1
    for directory in dump_dirs(run, name):
        group, prompt = want[directory.name]
        assert_matches_an_unsharded_forward(layout, directory, prompt)
        meta, _ = read_dump(directory)
        assert meta.extra[contract.PARALLEL_LAYOUT] == parallel_layout(server_args(layout, 0)).to_dict()
        assert meta.extra["dp_rank"] == (group if dp else None)  # written by its own group's leader


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_layouts_the_capture_cannot_follow_are_refused_saying_why(run: Run, name: str) -> None:
    outcome = [r[name] for r in run.ranks]
    for rank, o in enumerate(outcome):
        words = REFUSED[name].get(rank)
        if words is None:
            assert o["refused"] is None, (rank, o)
        else:
            assert o["refused"] is not None and words in o["refused"], (rank, o)
        assert not o["served"]
    assert dump_dirs(run, name) == []


def test_without_the_pp_refusal_every_capture_would_be_dropped(run: Run) -> None:
    # each stage's first rank would capture; its hooks on the other stage's layers never fire
    outcome = [r["pp2-tp2-bypass"] for r in run.ranks]
    assert [o["capture"] for o in outcome] == [True, False, True, False]
    assert all(o["served"] for o in outcome)
    assert outcome[0]["dumps"] == outcome[2]["dumps"] == 0
    assert outcome[0]["errors"] > 0 and outcome[2]["errors"] > 0
    assert "hooks fired [1, 0, 0, 0]" in run.log and "hooks fired [0, 1, 1, 1]" in run.log
    assert dump_dirs(run, "pp2-tp2-bypass") == []


def test_without_any_check_an_all_to_all_at_attention_tp_2_drops_captures_and_never_writes_wrong(
    run: Run,
) -> None:
    name = "tp4-dp2-dpattn-deepep-bypass-all"
    layout, want = BY_NAME[name], expected_dumps(BY_NAME[name])
    outcome = [r[name] for r in run.ranks]
    assert all(o["served"] for o in outcome) and outcome[0]["errors"] > 0
    written = dump_dirs(run, name)
    assert len(written) < len(want)  # the leader held only its tensor_split share of a pass's rows
    for directory in written:  # a pass whose rows all fell in the leader's share is right
        assert_matches_an_unsharded_forward(layout, directory, want[directory.name][1])
    assert "unexpected hidden state shape" in run.log
