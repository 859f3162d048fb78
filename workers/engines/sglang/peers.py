"""A multi-node launch: every node must run the hsx launcher, with the flags that matter to the capture.

Each node of ``--nnodes N`` starts its own launcher, and so its own SGLang with its own final server
arguments. A node that runs plain SGLang, or the launcher with other flags, runs other collectives or other
kernels than node 0 (on Blackwell, FlashInfer's all-reduce fusion switches itself on when ``nnodes > 1``, and
only the launcher turns it off), so the residual node 0's leader captures would be the sum of mismatched
partial results; and a DP group's leader on a node that does not run the plugin captures nothing.

Once SGLang's torch.distributed world is up (every scheduler of every node has joined it), every scheduler
of an hsx launcher posts what it runs with to the world's key-value store (the TCP store at
``--dist-init-addr``, which node 0's rank 0 serves): rank 0 waits for every other rank's post and compares
it with its own; every other rank waits for rank 0's and compares. A rank that never posts within the wait
(``HSX_SGLANG_PEER_WAIT_SECONDS``) runs no hsx plugin: the launch is refused on the side that waited, with
the ranks and nodes named. With ``--shared-dump-dir``, rank 0 also leaves a marker file in its dump
directory and every other node must see it in its own.

What cannot be checked: a node whose every scheduler is plain SGLang checks nothing itself; node 0 (or, if
node 0 is the plain one, every other node) refuses the launch instead, after the wait.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

PREFIX = "hsx/peers/"
MARKER_KEY = PREFIX + "marker"
MARKER_FILE = ".hsx-shared-dump-dir-{token}"

# SGLang's final server arguments that change which collectives run, or what a rank holds at the hook.
CAPTURE_SERVER_ARGS = (
    "tp_size",
    "dp_size",
    "pp_size",
    "nnodes",
    "enable_dp_attention",
    "attn_cp_size",
    "ep_size",
    "moe_a2a_backend",
    "moe_dense_tp_size",
    "moe_runner_backend",
    "dwdp_size",
    "disable_flashinfer_cutlass_moe_fp4_allgather",
    "flashinfer_allreduce_fusion_backend",
    "enforce_disable_flashinfer_allreduce_fusion",
    "enable_aiter_allreduce_fusion",
    "enable_attn_tp_input_scattered",
    "disable_custom_all_reduce",
    "attention_backend",
    "dtype",
    "quantization",
)


class PeerMismatch(RuntimeError):
    """A node does not run the hsx launcher, or runs it with other flags that matter to the capture."""


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def capture_flags(server_args: Any, cfg: Any, version: str | None) -> dict[str, Any]:
    """What every node must agree on: the server arguments above, the prefill graph backend, the hsx
    flags of the capture and the SGLang version."""
    flags = {name: _plain(getattr(server_args, name, None)) for name in CAPTURE_SERVER_ARGS}
    prefill = getattr(
        getattr(getattr(server_args, "cuda_graph_config", None), "prefill", None), "backend", None
    )
    flags["prefill_cuda_graph_backend"] = _plain(prefill)
    flags["sglang_version"] = version
    flags["hsx_aux_layer_ids"] = list(cfg.aux_layer_ids) if cfg.aux_layer_ids else None
    flags["hsx_final_state"] = cfg.final_state
    flags["hsx_shared_dump_dir"] = bool(cfg.shared_dump_dir)
    return flags


def launch_store() -> Any:
    """The key-value store of SGLang's torch.distributed world (tests hand in their own)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def node_of(rank: int, world_size: int, nnodes: int) -> int:
    """SGLang gives each node a contiguous block of ranks."""
    return rank // max(1, world_size // max(1, nnodes))


def _key(rank: int) -> str:
    return f"{PREFIX}{rank}"


def _sees_key(rank: int) -> str:
    return f"{PREFIX}{rank}/sees-dump-dir"


def _missing(store: Any, keys: Sequence[str], wait_s: float) -> list[str]:
    """The keys not posted within ``wait_s`` (waiting once for all of them)."""
    try:
        store.wait(list(keys), timedelta(seconds=wait_s))
        return []
    except RuntimeError:  # torch's DistStoreError (a timeout) is one
        return [k for k in keys if not store.check([k])]


def _differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    return [
        f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here"
        for k in sorted(set(mine) | set(theirs))
        if mine.get(k) != theirs.get(k)
    ]


def check_peers(
    store: Any,
    rank: int,
    world_size: int,
    nnodes: int,
    flags: dict[str, Any],
    wait_s: float,
    dump_dir: str | None = None,
    shared_dump_dir: bool = False,
) -> None:
    """Post this rank's flags and check them against the other nodes' (see the module doc); raises
    :class:`PeerMismatch` with the reason. Every rank posts before it waits, so no rank's post waits on
    another's: only a rank that runs no hsx plugin leaves a wait to time out."""
    node = node_of(rank, world_size, nnodes)
    if rank == 0:
        marker = None
        if shared_dump_dir and dump_dir:
            token = secrets.token_hex(8)
            marker = os.path.join(dump_dir, MARKER_FILE.format(token=token))
            os.makedirs(dump_dir, exist_ok=True)
            with open(marker, "w"):
                pass
            store.set(MARKER_KEY, token)  # before rank 0's post: whoever sees that post finds the token
        store.set(_key(0), json.dumps(flags))
        try:
            _check_all(store, world_size, nnodes, flags, wait_s, bool(marker))
        finally:
            if marker is not None:
                os.unlink(marker)
        return
    store.set(_key(rank), json.dumps(flags))
    if _missing(store, [_key(0)], wait_s):
        raise PeerMismatch(
            f"rank 0 (node 0) did not say within {wait_s:g} s how it runs: node 0 does not run the hsx "
            f"launcher (this is node {node}); start every node with `hsx engine --backend sglang`"
        )
    if shared_dump_dir and dump_dir:
        token = store.get(MARKER_KEY).decode()
        sees = os.path.exists(os.path.join(dump_dir, MARKER_FILE.format(token=token)))
        store.set(_sees_key(rank), "1" if sees else "0")
    diff = _differences(flags, json.loads(store.get(_key(0))))
    if diff:
        raise PeerMismatch(f"node 0 runs with other flags than node {node}: " + "; ".join(diff))


def _check_all(
    store: Any, world_size: int, nnodes: int, flags: dict[str, Any], wait_s: float, marker: bool
) -> None:
    others = range(1, world_size)
    missing = [r for r in others if _key(r) in _missing(store, [_key(r) for r in others], wait_s)]
    if missing:
        nodes = sorted({node_of(r, world_size, nnodes) for r in missing})
        raise PeerMismatch(
            f"ranks {missing} (node(s) {nodes}) did not say within {wait_s:g} s how they run: they do not "
            "run the hsx launcher (plain SGLang?); start every node with `hsx engine --backend sglang` and "
            "the same flags"
        )
    problems: dict[int, str] = {}  # the first problem of each node (its ranks were started alike)
    for r in others:
        other = node_of(r, world_size, nnodes)
        diff = _differences(flags, json.loads(store.get(_key(r))))
        if diff:
            problems.setdefault(other, f"node {other} (rank {r}) runs with other flags: " + "; ".join(diff))
    if marker and not problems:  # every other rank said it runs with --shared-dump-dir too
        remote = [r for r in others if node_of(r, world_size, nnodes) != 0]
        unseen = _missing(store, [_sees_key(r) for r in remote], wait_s)
        for r in remote:
            if _sees_key(r) in unseen or store.get(_sees_key(r)) != b"1":
                other = node_of(r, world_size, nnodes)
                problems.setdefault(
                    other, f"node {other} (rank {r}) does not see node 0's dump dir in its own"
                )
    if problems:
        raise PeerMismatch("; ".join(problems.values()))
