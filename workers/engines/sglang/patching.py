"""The scheduler-process entry point and the patches it applies to SGLang's classes (DP group leaders).

The launcher passes :func:`run_scheduler_process` to ``launch_server(run_scheduler_process_func=...)``;
SGLang *spawns* every scheduler with it (the DP controller too), so the patches are applied in the process
that runs the model. Each attention-DP group's first rank (TP rank 0 without DP attention; every replica's
under plain DP) captures its own group's requests: after every reduction it holds the group's whole residual
stream (:mod:`layouts`). On those ranks it wraps

* ``TpModelWorker.__init__``: after the model loads, create the :class:`capture.Capture` (hooks);
* ``TpModelWorker.forward_batch_generation``: plan the captured rows before an EXTEND/MIXED forward,
  hand them to the writers after it;
* ``Scheduler.abort_request`` / ``process_pending_chunked_abort``: drop partial captures of aborted
  requests.

Under ``--nnodes > 1`` every rank also wraps ``TpModelWorker.__init__`` to check, once the distributed
world is up, that every node runs the hsx launcher with the same flags (:mod:`peers`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any

from workers.engines.sglang.config import PluginConfig, version_problem
from workers.engines.sglang.guards import unsupported_config
from workers.engines.sglang.layouts import is_capture_leader

log = logging.getLogger("hsx.sglang")

_STATE: dict[str, Any] = {"capture": None, "installed": False, "peers_checked": False}


def current_capture() -> Any:
    return _STATE["capture"]


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """Drop-in for ``sglang.srt.managers.scheduler.run_scheduler_process``: check, patch, then run it."""
    from sglang.srt.managers import scheduler as scheduler_mod

    orig = scheduler_mod.run_scheduler_process
    bound = inspect.signature(orig).bind(*args, **kwargs)
    server_args = bound.arguments["server_args"]
    tp_rank = int(bound.arguments.get("tp_rank", 0) or 0)
    pp_rank = int(bound.arguments.get("pp_rank", 0) or 0)
    cfg = PluginConfig.from_env()
    problems = unsupported_config(server_args, cfg.shared_dump_dir)
    if not cfg.allow_any_version:
        import sglang

        problem = version_problem(getattr(sglang, "__version__", None))
        if problem:
            problems.append(problem)
    if problems:
        raise RuntimeError("hsx sglang plugin cannot capture with: " + "; ".join(problems))
    leader = is_capture_leader(server_args, tp_rank, pp_rank)
    multinode = int(getattr(server_args, "nnodes", 1) or 1) > 1
    if leader or multinode:
        install(cfg, server_args, capture=leader, dp_rank=bound.arguments.get("dp_rank"), peers=multinode)
    return orig(*args, **kwargs)


def install(
    cfg: PluginConfig, server_args: Any, capture: bool = True, dp_rank: Any = None, peers: bool = False
) -> None:
    """Patch the SGLang classes of this process: the capture on a DP group's leader (``capture``), the
    check of the other nodes on every rank of a multi-node launch (``peers``)."""
    if _STATE["installed"]:
        return
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker

    from workers.engines.sglang.capture import Capture

    _STATE["installed"] = True
    orig_init = TpModelWorker.__init__

    @functools.wraps(orig_init)
    def init(self: Any, *a: Any, **k: Any) -> None:
        orig_init(self, *a, **k)
        if getattr(self, "is_draft_worker", False):
            return
        if peers and not _STATE["peers_checked"]:
            check_other_nodes(cfg, server_args)  # the world is up once the worker is
            _STATE["peers_checked"] = True
        if capture and _STATE["capture"] is None:
            _STATE["capture"] = Capture.create(cfg, self.model_runner, server_args, dp_rank)

    TpModelWorker.__init__ = init
    if not capture:
        return
    if cfg.switch_interval_ms > 0:
        # SGLang's scheduler loop runs Python without pause; each writer thread needs the GIL back after
        # every syscall, and at Python's 5 ms a dump of an 8B model took 4x longer to write (docs/sglang.md).
        sys.setswitchinterval(cfg.switch_interval_ms / 1000)
    TpModelWorker.forward_batch_generation = wrap_forward(TpModelWorker.forward_batch_generation)
    for name in ("abort_request", "process_pending_chunked_abort"):
        orig = getattr(Scheduler, name, None)
        if orig is None:
            log.warning("hsx: Scheduler.%s not found; aborted partial captures are swept per forward", name)
            continue
        setattr(Scheduler, name, sweep_after(orig))


def check_other_nodes(cfg: PluginConfig, server_args: Any) -> None:
    """Refuse to run unless every node's schedulers run the hsx plugin with this node's flags."""
    import torch.distributed as dist

    from workers.engines.sglang import peers

    try:
        import sglang

        version = getattr(sglang, "__version__", None)
    except Exception:
        version = None
    try:
        peers.check_peers(
            peers.launch_store(),
            dist.get_rank(),
            dist.get_world_size(),
            int(getattr(server_args, "nnodes", 1) or 1),
            peers.capture_flags(server_args, cfg, version),
            cfg.peer_wait_seconds,
            cfg.dump_dir,
            cfg.shared_dump_dir,
        )
    except peers.PeerMismatch as exc:
        log.error("hsx: refusing this multi-node launch: %s", exc)
        raise


def wrap_forward(orig_fbg: Any, capture: Any = None) -> Any:
    """``forward_batch_generation`` with the capture around it (``capture``: fixed, for tests)."""

    @functools.wraps(orig_fbg)
    def forward_batch_generation(self: Any, batch: Any = None, *a: Any, **k: Any) -> Any:
        cap = capture if capture is not None else _STATE["capture"]
        if cap is None or batch is None:
            return orig_fbg(self, batch, *a, **k)
        active = cap.begin(self, batch)
        if active is None:
            return orig_fbg(self, batch, *a, **k)
        cap.active = active
        try:
            result = orig_fbg(self, batch, *a, **k)
        except BaseException:
            cap.active = None
            cap.finish(active, failed="the forward raised")
            raise
        cap.active = None
        cap.finish(active)
        return result

    return forward_batch_generation


def sweep_after(orig: Any, capture: Any = None) -> Any:
    """A scheduler method followed by a sweep of aborted partial captures."""

    @functools.wraps(orig)
    def wrapped(self: Any, *a: Any, **k: Any) -> Any:
        out = orig(self, *a, **k)
        cap = capture if capture is not None else _STATE["capture"]
        if cap is not None:
            try:
                cap.sweep()
            except Exception:  # never take the scheduler down for bookkeeping
                log.exception("hsx: sweep after %s failed", getattr(orig, "__name__", "?"))
        return out

    return wrapped
