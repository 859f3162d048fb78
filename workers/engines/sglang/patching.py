"""The scheduler-process entry point and the patches it applies to SGLang's classes (TP rank 0).

The launcher passes :func:`run_scheduler_process` to ``launch_server(run_scheduler_process_func=...)``;
SGLang *spawns* every scheduler with it, so the patches are applied in the process that runs the model.
On TP rank 0 only (after every reduction, each TP rank holds the same residual stream) it wraps

* ``TpModelWorker.__init__``: after the model loads, create the :class:`capture.Capture` (hooks);
* ``TpModelWorker.forward_batch_generation``: plan the captured rows before an EXTEND/MIXED forward,
  hand them to the writers after it;
* ``Scheduler.abort_request`` / ``process_pending_chunked_abort``: drop partial captures of aborted
  requests.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any

from workers.engines.sglang.config import PluginConfig, version_problem
from workers.engines.sglang.guards import unsupported_config

log = logging.getLogger("hsx.sglang")

_STATE: dict[str, Any] = {"capture": None, "installed": False}


def current_capture() -> Any:
    return _STATE["capture"]


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """Drop-in for ``sglang.srt.managers.scheduler.run_scheduler_process``: check, patch, then run it."""
    from sglang.srt.managers import scheduler as scheduler_mod

    orig = scheduler_mod.run_scheduler_process
    bound = inspect.signature(orig).bind(*args, **kwargs)
    server_args = bound.arguments["server_args"]
    tp_rank = int(bound.arguments.get("tp_rank", 0) or 0)
    cfg = PluginConfig.from_env()
    problems = unsupported_config(server_args)
    if not cfg.allow_any_version:
        import sglang

        problem = version_problem(getattr(sglang, "__version__", None))
        if problem:
            problems.append(problem)
    if problems:
        raise RuntimeError("hsx sglang plugin cannot capture with: " + "; ".join(problems))
    if tp_rank == 0:
        install(cfg, server_args)
    return orig(*args, **kwargs)


def install(cfg: PluginConfig, server_args: Any) -> None:
    """Patch the SGLang classes of this process (TP rank 0)."""
    if _STATE["installed"]:
        return
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker

    from workers.engines.sglang.capture import Capture

    _STATE["installed"] = True
    if cfg.switch_interval_ms > 0:
        # SGLang's scheduler loop runs Python without pause; each writer thread needs the GIL back after
        # every syscall, and at Python's 5 ms a dump of an 8B model took 4x longer to write (docs/sglang.md).
        sys.setswitchinterval(cfg.switch_interval_ms / 1000)
    orig_init = TpModelWorker.__init__
    orig_fbg = TpModelWorker.forward_batch_generation

    @functools.wraps(orig_init)
    def init(self: Any, *a: Any, **k: Any) -> None:
        orig_init(self, *a, **k)
        if _STATE["capture"] is None and not getattr(self, "is_draft_worker", False):
            _STATE["capture"] = Capture.create(cfg, self.model_runner, server_args)

    TpModelWorker.__init__ = init
    TpModelWorker.forward_batch_generation = wrap_forward(orig_fbg)
    for name in ("abort_request", "process_pending_chunked_abort"):
        orig = getattr(Scheduler, name, None)
        if orig is None:
            log.warning("hsx: Scheduler.%s not found; aborted partial captures are swept per forward", name)
            continue
        setattr(Scheduler, name, sweep_after(orig))


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
