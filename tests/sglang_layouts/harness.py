"""Run the SGLang plugin over the stand-in model in every layout of :data:`LAYOUTS`, one process per rank.

``python -m tests.sglang_layouts.harness OUT`` imports torch once, forks :data:`WORLD` rank processes (no
threads exist before the fork), waits for all of them, and exits non-zero if one failed. Each rank joins a
gloo world and, for every layout in turn (in the same order on every rank, so that groups and collectives
match):

1. enters the plugin as SGLang would (``patching.run_scheduler_process`` with 0.5.17's arguments; a layout's
   ``plain`` ranks call the stand-in scheduler directly, as a node running plain SGLang would). The stand-in
   scheduler (a fake ``sglang.srt.managers.scheduler.run_scheduler_process``) builds the stand-in
   ``TpModelWorker``, whose ``__init__`` the plugin wrapped where it chose to capture;
2. all ranks agree whether every one of them started (one refusal stops the whole server, as in SGLang);
3. runs the batches of its group (each DP group its own requests, cut by chunked prefill, MAX_LEN padding,
   IDLE batches for a group with nothing left) through ``forward_batch_generation``;
4. flushes its capture and records, in ``OUT/rank<r>.json``, what happened (refusal, capture or none).

Dumps land in ``OUT/<layout>/``; the test compares them with the unsharded reference.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tests.sglang_layouts.standin import LAYERS, Group, Model, Par
from tests.sglang_layouts.workload import CHUNK, batches, group_requests
from workers.engines.sglang import capture as capture_mod
from workers.engines.sglang import patching, peers
from workers.engines.sglang.config import PluginConfig

WORLD = 4
PEER_WAIT_S = 30.0  # how long a rank waits for the other nodes' posts: they come, unless a node is plain
SHORT_WAIT = {"HSX_SGLANG_PEER_WAIT_SECONDS": "0.5"}  # where a wait must run out: its posts never come


@dataclass
class Layout:
    name: str
    server: dict[str, Any]  # SGLang's final server arguments that differ from a plain TP launch
    aux: list[int] = field(default_factory=lambda: [1, 2, 3])
    plain: tuple[int, ...] = ()  # ranks that run plain SGLang (no plugin)
    env: dict[int, dict[str, str]] = field(default_factory=dict)  # per-rank plugin environment overrides
    bypass: str = ""  # "guards": install where SGLang would without the refusals; "+attach": and the
    # plugin's own check of the model's scatter modes
    # rank -> rank whose peer post it sees before its own check starts (so a short wait misses only ranks
    # that never post, whatever the scheduling)
    init_after: dict[int, int] = field(default_factory=dict)


DP4 = {"tp_size": 4, "dp_size": 4, "enable_dp_attention": True}
DP2 = {"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}
DEEPEP = {"moe_a2a_backend": "deepep"}
DENSE_TP1 = {"moe_dense_tp_size": 1}
TWO_NODES = {"tp_size": 4, "nnodes": 2}
SHARED = {r: {"HSX_SGLANG_SHARED_DUMP_DIR": "1"} for r in range(WORLD)}
PRE_ON_NODE_1 = {r: {"HSX_SGLANG_FINAL_STATE": "pre"} for r in (2, 3)}
LAYOUTS = [
    Layout("tp4", {"tp_size": 4}),
    Layout("tp4-ep4", {"tp_size": 4, "ep_size": 4}),
    Layout("dp2-replicas-tp2", {"tp_size": 2, "dp_size": 2}),
    Layout("tp4-dp4-dpattn", DP4),
    Layout("tp4-dp4-dpattn-deepep-densetp1", {**DP4, **DEEPEP, **DENSE_TP1}, aux=[0, 2, 3]),
    Layout("tp4-dp2-dpattn", DP2),
    Layout("tp4-dp2-dpattn-densetp1", {**DP2, **DENSE_TP1}),
    Layout("tp4-2nodes", TWO_NODES),
    Layout("tp4-dp4-dpattn-2nodes-shared", {**DP4, "nnodes": 2}, env=SHARED),
    # refused
    Layout("tp4-deepep", {"tp_size": 4, **DEEPEP}),
    Layout("tp4-dp2-dpattn-deepep", {**DP2, **DEEPEP}),
    Layout("tp4-dp2-dpattn-deepep-bypass", {**DP2, **DEEPEP}, bypass="guards"),
    Layout("tp4-dp2-dpattn-deepep-bypass-all", {**DP2, **DEEPEP}, bypass="guards+attach"),
    Layout("tp4-dp2-dpattn-densetp1-dense-aux", {**DP2, **DENSE_TP1}, aux=[0, 2, 3]),
    Layout("pp2-tp2", {"tp_size": 2, "pp_size": 2}),
    Layout("pp2-tp2-bypass", {"tp_size": 2, "pp_size": 2}, bypass="guards"),
    Layout("tp4-dp4-dpattn-2nodes", {**DP4, "nnodes": 2}),
    Layout("tp4-2nodes-mismatch", TWO_NODES, env=PRE_ON_NODE_1),
    Layout("tp4-2nodes-plain-node1", TWO_NODES, plain=(2, 3), env={0: SHORT_WAIT}, init_after={0: 1}),
]


@dataclass
class Roles:
    """One rank's place in a layout, in SGLang's numbering."""

    tp_rank: int  # within its replica (plain DP) or stage (PP); global under DP attention
    pp_rank: int
    dp_rank: int | None  # what SGLang hands the scheduler: the attention-DP group, or the replica
    group: int  # whose requests it serves: its DP group, or its replica
    groups: int
    node_rank: int
    tp_ranks: tuple[int, ...]  # global ranks of its TP group
    attn_ranks: tuple[int, ...]  # global ranks of its attention group


def server_args(layout: Layout, node_rank: int) -> Any:
    args = dict(
        tp_size=1,
        dp_size=1,
        enable_dp_attention=False,
        ep_size=1,
        moe_a2a_backend="none",
        moe_dense_tp_size=None,
        pp_size=1,
        nnodes=1,
        attn_cp_size=1,
        flashinfer_allreduce_fusion_backend=None,
        disaggregation_mode="null",
        chunked_prefill_size=CHUNK,
        attention_backend="torch_native",
        disable_radix_cache=True,
        dtype="float32",
    )
    args.update(layout.server)
    return SimpleNamespace(node_rank=node_rank, **args)


def roles(layout: Layout, rank: int) -> Roles:
    s = server_args(layout, 0)
    tp, pp, dp = s.tp_size, s.pp_size, s.dp_size
    node = rank // (WORLD // s.nnodes)
    if s.enable_dp_attention:
        attn = tp // dp
        base = rank // attn * attn
        return Roles(
            rank, 0, rank // attn, rank // attn, dp, node, tuple(range(tp)), tuple(range(base, base + attn))
        )
    block = rank // tp * tp  # a replica's, or a PP stage's, ranks
    ranks = tuple(range(block, block + tp))
    replica = rank // tp if dp > 1 else 0
    return Roles(
        rank % tp, rank // tp if pp > 1 else 0, replica if dp > 1 else None, replica, dp, node, ranks, ranks
    )


_GROUPS: dict[tuple[int, ...], Any] = {}


def layout_groups(layout: Layout) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every rank's TP and attention group; every rank creates every group of the layout, in one order."""
    out = {r: (roles(layout, r).tp_ranks, roles(layout, r).attn_ranks) for r in range(WORLD)}
    for ranks in sorted({g for pair in out.values() for g in pair if len(g) > 1}):
        if ranks not in _GROUPS:
            _GROUPS[ranks] = dist.new_group(list(ranks))
    return out


def par_of(layout: Layout, rank: int, groups: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]) -> Par:
    s, me = server_args(layout, 0), roles(layout, rank)
    tp_ranks, attn_ranks = groups[rank]
    par = Par(
        tp=Group(tp_ranks.index(rank), len(tp_ranks), _GROUPS.get(tp_ranks)),
        attn=Group(attn_ranks.index(rank), len(attn_ranks), _GROUPS.get(attn_ranks)),
        dp_rank=me.group if s.enable_dp_attention else 0,
        dp_size=s.dp_size if s.enable_dp_attention else 1,
        ep=s.ep_size > 1,
        a2a=s.moe_a2a_backend != "none",
        dense_fully_dp=s.moe_dense_tp_size == 1,
    )
    if s.pp_size > 1:
        per = LAYERS // s.pp_size
        par.stage_layers = range(me.pp_rank * per, (me.pp_rank + 1) * per)
        par.prev_stage = rank - s.tp_size if me.pp_rank > 0 else None
        par.next_stage = rank + s.tp_size if me.pp_rank < s.pp_size - 1 else None
    return par


def fake_sglang(ctx: SimpleNamespace) -> None:
    """The three SGLang names the plugin touches, fresh for a layout; the scheduler stops where SGLang's
    would start serving (the harness then feeds its batches)."""
    worker_mod = types.ModuleType("sglang.srt.managers.tp_worker")

    class TpModelWorker:
        def __init__(self) -> None:
            for rank in ctx.init_after:
                peers.launch_store().wait([f"{peers.PREFIX}{rank}"])
            text = SimpleNamespace(num_hidden_layers=LAYERS, hidden_size=16)
            self.model_runner = SimpleNamespace(
                model=Model(ctx.par), model_config=SimpleNamespace(hf_text_config=text), dtype=torch.float32
            )

        def forward_batch_generation(self, batch: Any = None, *a: Any, **k: Any) -> Any:
            with torch.no_grad():
                return self.model_runner.model.model(*batch.inputs, batch.fb)

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
        ctx.worker = worker_mod.TpModelWorker()  # type: ignore[attr-defined]
        return "ran"

    class Scheduler:
        def abort_request(self, *_a: Any) -> None:
            return None

        def process_pending_chunked_abort(self) -> None:
            return None

    pkg = types.ModuleType("sglang")
    pkg.__version__ = "0.5.17"  # type: ignore[attr-defined]
    sched = types.ModuleType("sglang.srt.managers.scheduler")
    sched.run_scheduler_process = run_scheduler_process  # type: ignore[attr-defined]
    sched.Scheduler = Scheduler  # type: ignore[attr-defined]
    worker_mod.TpModelWorker = TpModelWorker  # type: ignore[attr-defined]
    sys.modules.update(
        {
            "sglang": pkg,
            "sglang.srt": types.ModuleType("sglang.srt"),
            "sglang.srt.managers": types.ModuleType("sglang.srt.managers"),
            "sglang.srt.managers.scheduler": sched,
            "sglang.srt.managers.tp_worker": worker_mod,
        }
    )
    patching._STATE = {"capture": None, "installed": False, "peers_checked": False}


def start(layout: Layout, rank: int, me: Roles, ctx: SimpleNamespace, out: Path) -> str | None:
    """Enter the plugin as SGLang would; the refusal, if any."""
    cfg = PluginConfig(
        str(out / layout.name), layout.aux, pinned_mb=1, writer_threads=1, stats_seconds=0,
        switch_interval_ms=0, peer_wait_seconds=PEER_WAIT_S,
    )  # fmt: skip
    os.environ.update({**cfg.to_env(), **layout.env.get(rank, {})})
    args = server_args(layout, me.node_rank)
    orig = sys.modules["sglang.srt.managers.scheduler"].run_scheduler_process  # type: ignore[attr-defined]
    call = (args, None, 0, me.tp_rank, 0, 0, 0, me.pp_rank, me.dp_rank, None)
    try:
        if rank in layout.plain:
            orig(*call)
        elif layout.bypass:
            # what lifting the launcher's refusals would run: the capture on each stage's (each group's)
            # first rank, with the plugin's own model check too unless "+attach" pretends attention TP 1
            if "attach" in layout.bypass:
                capture_mod.attention_tp_size = lambda _args: 1  # type: ignore[assignment]
            first = me.tp_rank % (len(me.attn_ranks)) == 0
            patching.install(PluginConfig.from_env(), args, capture=first, dp_rank=me.dp_rank)
            orig(*call)
        else:
            patching.run_scheduler_process(*call)
    except Exception as exc:  # a refusal: the scheduler dies, and with it the server
        return f"{type(exc).__name__}: {exc}"
    return None


def run_layout(layout: Layout, rank: int, out: Path) -> dict[str, Any]:
    groups = layout_groups(layout)
    me = roles(layout, rank)
    ctx = SimpleNamespace(par=par_of(layout, rank, groups), worker=None, init_after=[])
    if rank in layout.init_after:
        ctx.init_after.append(layout.init_after[rank])
    fake_sglang(ctx)
    base = peers.launch_store
    peers.launch_store = lambda: dist.PrefixStore(
        f"{layout.name}/", dist.distributed_c10d._get_default_store()
    )
    attention_tp = capture_mod.attention_tp_size
    try:
        refused = start(layout, rank, me, ctx, out)
    finally:
        peers.launch_store, capture_mod.attention_tp_size = base, attention_tp  # type: ignore[assignment]
    started = torch.tensor([0 if refused else 1])
    dist.all_reduce(started, op=dist.ReduceOp.MIN)  # one scheduler's death stops every one
    cap = patching.current_capture()
    result: dict[str, Any] = {"refused": refused, "served": bool(started.item()), "capture": cap is not None}
    if started.item():
        s = server_args(layout, 0)
        plan = group_requests(layout.name, me.groups)
        pad = s.enable_dp_attention or s.moe_a2a_backend != "none" or s.moe_dense_tp_size == 1
        attn = len(me.attn_ranks)
        for batch in batches(plan, me.group, me.groups if s.enable_dp_attention else 1, attn, pad):
            ctx.worker.forward_batch_generation(batch)
    if cap is not None:
        assert cap.flush(30)
        cap.writer.stop()
        result.update(cap.stats.snapshot(), dp_rank=cap.engine_extra.get("dp_rank"))
    dist.barrier()
    return result


PORT_RECORD = 6  # bytes of one port as rank 0 writes it to the others: five digits and a newline


def rendezvous(rank: int, ports: tuple[int, int]) -> Any:
    """The ranks' store: rank 0 serves it on a port the kernel picked (port 0) and writes that port down
    the pipe once per other rank; each other rank reads one record (a write of PIPE_BUF bytes or less is
    atomic) and connects to it. No port is picked before the server holds it."""
    read_end, write_end = ports
    if rank == 0:
        os.close(read_end)
        # Not waiting for the others here: they learn the port from the lines written below.
        store = dist.TCPStore("127.0.0.1", 0, WORLD, True, timedelta(seconds=60), wait_for_workers=False)
        for _ in range(WORLD - 1):
            os.write(write_end, f"{store.port:05d}\n".encode())
        os.close(write_end)
        return store
    os.close(write_end)
    record = b""
    while len(record) < PORT_RECORD:
        chunk = os.read(read_end, PORT_RECORD - len(record))
        if not chunk:
            raise RuntimeError("rank 0 closed the pipe before it wrote its store's port")
        record += chunk
    os.close(read_end)
    return dist.TCPStore("127.0.0.1", int(record), WORLD, False, timedelta(seconds=60))


def run_rank(rank: int, out: Path, ports: tuple[int, int]) -> int:
    torch.set_num_threads(1)
    store = rendezvous(rank, ports)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    code = 0
    for layout in LAYOUTS:
        t0 = time.perf_counter()
        try:
            results[layout.name] = run_layout(layout, rank, out)
            results[layout.name]["seconds"] = round(time.perf_counter() - t0, 3)
        except Exception:
            results[layout.name] = {"crashed": traceback.format_exc()}
            code = 1
            break  # the other ranks are in a collective this one left: they time out and stop too
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return code


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    ports = os.pipe()  # rank 0 writes its store's port here for the others
    children = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:  # the child: no thread exists yet in this process, so forking is safe
            code = 1
            try:
                code = run_rank(rank, out, ports)
            except BaseException:
                traceback.print_exc()  # the rendezvous: the layouts report their own failures
                raise
            finally:
                os._exit(code)
        children.append(pid)
    for end in ports:
        os.close(end)  # the parent's ends: a rank reading a pipe whose rank 0 died sees it closed
    failed = 0
    for pid in children:  # every child is reaped, whatever the others did
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
