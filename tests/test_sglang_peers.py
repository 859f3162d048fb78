"""The multi-node check (workers/engines/sglang/peers.py) on an in-process store, one thread per rank: what
the four-process run (tests/test_sglang_layouts.py) cannot show on one host, a node that does not see node
0's dump directory under --shared-dump-dir, and what every node must agree on."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from workers.engines.sglang import peers
from workers.engines.sglang.config import PluginConfig


def check_all(dump_dirs: list[Path], shared: bool = True) -> dict[int, str | None]:
    """Each rank's check on one store, concurrently (ranks 0-1 node 0, ranks 2-3 node 1)."""
    store = dist.HashStore()
    flags = {"tp_size": 4, "hsx_final_state": "post"}
    outcome: dict[int, str | None] = {}

    def rank(r: int) -> None:
        try:
            peers.check_peers(store, r, 4, 2, flags, 30.0, str(dump_dirs[r]), shared)
            outcome[r] = None
        except peers.PeerMismatch as exc:
            outcome[r] = str(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


def test_a_node_that_does_not_see_node_0s_dump_dir_is_refused(tmp_path: Path) -> None:
    here, there = tmp_path / "node0", tmp_path / "node1"
    there.mkdir()
    outcome = check_all([here, here, there, there])
    assert outcome[0] == "node 1 (rank 2) does not see node 0's dump dir in its own"
    assert outcome[1] is None and outcome[2] is None and outcome[3] is None  # rank 0 judges, and stops all
    assert list(here.iterdir()) == []  # the marker is gone


def test_a_shared_dump_dir_passes_and_leaves_nothing(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    assert check_all([shared] * 4) == dict.fromkeys(range(4))
    assert list(shared.iterdir()) == []


def test_what_every_node_must_agree_on() -> None:
    args = SimpleNamespace(
        tp_size=8,
        nnodes=2,
        flashinfer_allreduce_fusion_backend=None,
        cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend="disabled")),
    )
    cfg = PluginConfig("/d", [3, 31, 59], final_state="both")
    flags = peers.capture_flags(args, cfg, "0.5.17")
    assert flags["tp_size"] == 8 and flags["flashinfer_allreduce_fusion_backend"] is None
    assert flags["prefill_cuda_graph_backend"] == "disabled" and flags["sglang_version"] == "0.5.17"
    assert flags["hsx_aux_layer_ids"] == [3, 31, 59] and flags["hsx_final_state"] == "both"
    # a plain SGLang node 1 on Blackwell: the fusion switched itself on, and the launcher's switch is off
    plain: dict[str, Any] = {**flags, "flashinfer_allreduce_fusion_backend": "auto"}
    assert peers._differences(flags, plain) == [
        "flashinfer_allreduce_fusion_backend: 'auto' there, None here"
    ]


@pytest.mark.parametrize(("rank", "node"), [(0, 0), (7, 0), (8, 1), (15, 1)])
def test_nodes_hold_contiguous_ranks(rank: int, node: int) -> None:
    assert peers.node_of(rank, 16, 2) == node
