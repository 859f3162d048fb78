"""The scheduler-process entry point: checks again, patches on TP rank 0 only, then runs SGLang's own.

SGLang cannot be imported here (no accelerator; its import needs triton), so the three SGLang names the
entry point touches (``scheduler.run_scheduler_process`` with 0.5.17's signature, ``Scheduler`` and
``TpModelWorker``) are stand-in modules in ``sys.modules``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hsx import contract
from tests.test_sglang_capture import AUX, LAYERS, Model, Req, batch, prompt
from tests.test_sglang_capture import H as HIDDEN
from workers.engines.sglang import patching
from workers.engines.sglang.config import SUPPORTED_RANGE, PluginConfig


class Scheduler:
    def abort_request(self, *_a: Any) -> str:
        return "aborted"

    def process_pending_chunked_abort(self) -> str:
        return "swept"


class TpModelWorker:
    """SGLang's worker as far as the plugin sees it: a model runner and a forward over a ScheduleBatch."""

    def __init__(self) -> None:
        text_config = SimpleNamespace(num_hidden_layers=LAYERS, hidden_size=HIDDEN)
        self.model_runner = SimpleNamespace(
            model=Model(), model_config=SimpleNamespace(hf_text_config=text_config), dtype=torch.float32
        )

    def forward_batch_generation(self, batch: Any = None, *a: Any, **k: Any) -> str:
        ids, positions = [], []
        for req, pre, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
            ids += req.origin_input_ids[pre : pre + ext]
            positions += list(range(pre, pre + ext))
        with torch.no_grad():
            self.model_runner.model.model(torch.tensor(ids), torch.tensor(positions), batch)
        return "forward"


CALLS: list[dict[str, Any]] = []


def run_scheduler_process(
    server_args: Any,
    port_args: Any,
    gpu_id: int,
    tp_rank: int,
    attn_cp_rank: int,
    moe_dp_rank: int,
    moe_ep_rank: int,
    pp_rank: int,
    dp_rank: Any,
    pipe_writer: Any,
    display_tp_rank: Any = None,
    display_dp_rank: Any = None,
    display_moe_ep_rank: Any = None,
) -> str:
    CALLS.append({"tp_rank": tp_rank})
    return "ran"


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[types.ModuleType]:
    pkg = types.ModuleType("sglang")
    pkg.__version__ = "0.5.17"  # type: ignore[attr-defined]
    sched = types.ModuleType("sglang.srt.managers.scheduler")
    sched.run_scheduler_process = run_scheduler_process  # type: ignore[attr-defined]
    sched.Scheduler = type("Scheduler", (Scheduler,), {})  # type: ignore[attr-defined]
    worker = types.ModuleType("sglang.srt.managers.tp_worker")
    worker.TpModelWorker = type("TpModelWorker", (TpModelWorker,), {})  # type: ignore[attr-defined]
    for name, mod in {
        "sglang": pkg,
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.managers": types.ModuleType("sglang.srt.managers"),
        "sglang.srt.managers.scheduler": sched,
        "sglang.srt.managers.tp_worker": worker,
    }.items():
        monkeypatch.setitem(__import__("sys").modules, name, mod)
    monkeypatch.setattr(patching, "_STATE", {"capture": None, "installed": False})
    cfg = PluginConfig(
        str(tmp_path / "dumps"), AUX, pinned_mb=1, writer_threads=1, stats_seconds=0, switch_interval_ms=0.25
    )
    for key, value in cfg.to_env().items():
        monkeypatch.setenv(key, value)
    CALLS.clear()
    interval = sys.getswitchinterval()
    yield pkg
    sys.setswitchinterval(interval)  # install() set the scheduler process's; this is the test process


def call(tp_rank: int, **server_args: Any) -> Any:
    args = SimpleNamespace(tp_size=2, **server_args)
    return patching.run_scheduler_process(args, None, 0, tp_rank, 0, 0, 0, 0, None, None)


def test_only_tp_rank_0_patches_sglang(fake_sglang: types.ModuleType, tmp_path: Path) -> None:
    import sglang.srt.managers.scheduler as sched
    import sglang.srt.managers.tp_worker as worker

    plain_forward = worker.TpModelWorker.forward_batch_generation
    interval = sys.getswitchinterval()
    assert call(1) == "ran"
    assert worker.TpModelWorker.forward_batch_generation is plain_forward and not patching._STATE["installed"]
    assert sys.getswitchinterval() == interval
    assert call(0) == "ran"
    # the writer threads get the GIL back from the scheduler loop after the configured interval
    assert sys.getswitchinterval() == pytest.approx(0.00025)
    assert worker.TpModelWorker.forward_batch_generation is not plain_forward and patching._STATE["installed"]
    assert [c["tp_rank"] for c in CALLS] == [1, 0]
    # the patched methods still do what SGLang's did, and the worker rank 0 builds now captures
    tp0 = worker.TpModelWorker()
    capture = patching.current_capture()
    assert capture is not None and capture.model is tp0.model_runner.model
    req = Req("hsx-rank0", prompt(1, 9))
    assert tp0.forward_batch_generation(batch([(req, 0, 9)])) == "forward"
    assert sched.Scheduler().abort_request("rid") == "aborted"
    assert sched.Scheduler().process_pending_chunked_abort() == "swept"
    assert capture.flush(30)
    meta = contract.DumpMeta.from_json((tmp_path / "dumps" / "hsx-rank0" / contract.META_FILE).read_text())
    assert meta.num_tokens == 9 and meta.extra["engine_version"] == "0.5.17" and meta.extra["tp_size"] == 2
    assert meta.extra["parallel_layout"]["tp"] == 2 and meta.extra["dp_rank"] is None


@pytest.mark.parametrize(
    ("layout", "leaders"),
    [
        ({"tp_size": 4}, {0: None}),
        ({"tp_size": 4, "dp_size": 4, "enable_dp_attention": True}, {0: 0, 1: 1, 2: 2, 3: 3}),
        ({"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}, {0: 0, 2: 1}),
        (
            {"tp_size": 4, "dp_size": 4, "enable_dp_attention": True, "moe_a2a_backend": "deepep"},
            {0: 0, 1: 1, 2: 2, 3: 3},
        ),
    ],
)
def test_every_dp_groups_leader_captures_and_no_other_rank(
    fake_sglang: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    layout: dict[str, Any],
    leaders: dict[int, Any],
) -> None:
    # Before DP attention was supported only global TP rank 0 captured: DP group 0's requests alone.
    installed: dict[int, Any] = {}

    def spy(
        cfg: Any, server_args: Any, capture: bool = True, dp_rank: Any = None, peers: bool = False
    ) -> None:
        assert not peers  # one node: nothing to check between nodes
        if capture:
            installed[tp_rank] = dp_rank

    monkeypatch.setattr(patching, "install", spy)
    for tp_rank in range(4):
        dp_rank = tp_rank * layout.get("dp_size", 1) // 4 if layout.get("enable_dp_attention") else None
        args = SimpleNamespace(**layout)
        assert patching.run_scheduler_process(args, None, 0, tp_rank, 0, 0, 0, 0, dp_rank, None) == "ran"
    assert installed == leaders


def test_a_multi_node_launch_checks_its_peers_on_every_rank(
    fake_sglang: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, bool, bool]] = []

    def spy(
        cfg: Any, server_args: Any, capture: bool = True, dp_rank: Any = None, peers: bool = False
    ) -> None:
        calls.append((tp_rank, capture, peers))

    monkeypatch.setattr(patching, "install", spy)
    for tp_rank in (2, 3):  # node 1 of a TP 4 launch over two nodes: no capture here, the check all the same
        args = SimpleNamespace(tp_size=4, nnodes=2, node_rank=1)
        patching.run_scheduler_process(args, None, 0, tp_rank, 0, 0, 0, 0, None, None)
    assert calls == [(2, False, True), (3, False, True)]


@pytest.mark.parametrize(
    ("server_args", "needle"),
    [
        ({"flashinfer_allreduce_fusion_backend": "auto"}, "FlashInfer all-reduce fusion"),
        ({"moe_a2a_backend": "deepep"}, "attention TP 2"),
        ({"pp_size": 2}, "different stages"),
    ],
)
def test_every_rank_refuses_what_the_launcher_refuses(
    fake_sglang: types.ModuleType, server_args: dict[str, Any], needle: str
) -> None:
    for rank in (0, 1):
        with pytest.raises(RuntimeError, match=needle):
            call(rank, **server_args)
    assert CALLS == [] and not patching._STATE["installed"]


def test_an_sglang_outside_the_range_is_refused_unless_overridden(
    fake_sglang: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_sglang.__version__ = "0.6.1"  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=SUPPORTED_RANGE):
        call(0)
    monkeypatch.setenv("HSX_SGLANG_ALLOW_ANY_VERSION", "1")
    assert call(0) == "ran"
