"""The capture inside one scheduler process (a DP group's leader): module hooks, per-forward plans, copies.

Hooks (one slot per dump tensor, in :func:`config.dump_tensor_names` order):

* a forward **pre-hook** on decoder layer ``L + 1`` for every aux layer ``L``: ``hidden_states +
  residual`` entering it is the output of layer ``L`` (HF ``hidden_states[L + 1]``);
* ``post``: a forward hook on the final norm (its output, HF ``hidden_states[N]``);
* ``pre``: a forward pre-hook on the final norm (``x + residual`` entering it: the last decoder layer's
  output, the norm's input).

In a hook, the captured spans are materialised on the forward stream (the next fused add-norm updates its
inputs in place), their non-finite values are counted per row on the GPU, and both are copied into a
pinned slice on a side stream (``non_blocking``; the forward stream never waits on the host). A hooked
tensor still tagged as waiting for its all-reduce fails the forward's capture: it is never written.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from hsx import contract
from workers.engines.sglang.arena import PinnedArena
from workers.engines.sglang.config import ENGINE_NAME, SAFETENSORS_DTYPES, PluginConfig, dump_tensor_names
from workers.engines.sglang.guards import NEEDS_ALLREDUCE_TAG, pending_reduction
from workers.engines.sglang.layouts import attention_tp_size, scattered_taps
from workers.engines.sglang.planning import Plan, Planner, ReqState
from workers.engines.sglang.writer import DumpWriter, Job, Stats

log = logging.getLogger("hsx.sglang")


@dataclass
class ActivePlan:
    plan: Plan
    block: Any
    u8: Any  # pinned uint8 [K, rows, row_bytes]
    dst: Any  # the same memory as the model dtype [K, rows, H]
    non_finite: Any  # pinned int32 [K, rows]
    fired: list[int]
    error: str | None = None


def find_decoder(model: Any) -> tuple[Any, Any]:
    """The decoder layer list and the final norm of an SGLang (or HF-shaped) causal LM."""
    for path in ("model", "language_model.model", "language_model", "transformer", ""):
        obj = model
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        layers = getattr(obj, "layers", None)
        norm = getattr(obj, "norm", None)
        if layers is not None and norm is not None:
            return layers, norm
    raise RuntimeError(f"hsx: cannot find decoder layers and final norm in {type(model).__name__}")


def _norm_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(x, residual, post_residual_addition)`` of an SGLang norm call (``forward(*args)``)."""
    x = args[0] if args else kwargs.get("x", kwargs.get("hidden_states"))
    res = args[1] if len(args) > 1 else kwargs.get("residual")
    extra = args[2] if len(args) > 2 else kwargs.get("post_residual_addition")
    return x, res, extra


class Capture:
    def __init__(
        self,
        cfg: PluginConfig,
        torch: Any,
        model: Any,
        num_layers: int,
        hidden_size: int,
        dtype: Any,
        device: Any,
        engine_extra: dict[str, Any] | None = None,
        attention_tp: int = 1,
    ) -> None:
        self.torch = torch
        self.attention_tp = attention_tp  # ranks sharing this leader's requests (layouts.py)
        self.cfg = cfg
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.dtype_name = str(dtype).replace("torch.", "")
        if self.dtype_name not in SAFETENSORS_DTYPES:
            raise RuntimeError(f"hsx: unsupported hidden-state dtype {dtype}")
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = hidden_size * self.itemsize
        self.aux = list(cfg.aux_layer_ids or contract.eagle3_aux_layer_ids(num_layers))
        self.hf = contract.hf_indices(self.aux, num_layers)
        self.final_state = cfg.final_state
        self.names = dump_tensor_names(self.hf, self.final_state)
        self.K = len(self.names)
        os.makedirs(cfg.dump_dir, exist_ok=True)
        self.engine_extra = dict(engine_extra or {})
        self.engine_extra["final_state"] = self.final_state
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.copy_stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.arena = PinnedArena(torch, cfg.pinned_mb << 20, pin=self.cuda)
        self.stats = Stats()
        self.writer = DumpWriter(
            torch,
            self.arena,
            cfg.dump_dir,
            self.names,
            SAFETENSORS_DTYPES[self.dtype_name],
            hidden_size,
            self.row_bytes,
            cfg.writer_threads,
            self.stats,
        )
        self.planner = Planner(self._make_meta, self.writer.drop)
        self.active: ActivePlan | None = None
        self.model: Any = None
        self._hooks: list[Any] = []
        self._sigs: dict[type, inspect.Signature] = {}
        self.sched_s = 0.0
        if cfg.stats_seconds > 0:
            threading.Thread(target=self._stats_loop, name="hsx-stats", daemon=True).start()
        self.attach(model)
        log.info(
            "hsx capture on: layers=%d hidden=%d dtype=%s aux=%s tensors=%s dump_dir=%s arena=%d MiB "
            "writers=%d",
            num_layers,
            hidden_size,
            self.dtype_name,
            self.aux,
            self.names,
            cfg.dump_dir,
            self.arena.size >> 20,
            cfg.writer_threads,
        )

    @classmethod
    def create(cls, cfg: PluginConfig, model_runner: Any, server_args: Any, dp_rank: Any = None) -> Capture:
        import torch

        model = model_runner.model
        text_cfg = getattr(model_runner.model_config, "hf_text_config", None) or model.config
        num_layers = int(text_cfg.num_hidden_layers)
        hidden = int(text_cfg.hidden_size)
        dtype = getattr(model_runner, "dtype", None) or next(model.parameters()).dtype
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        from workers.engines.sglang.launch_args import engine_extra

        try:  # the running SGLang's own word (a source checkout may have no package metadata)
            import sglang

            version = getattr(sglang, "__version__", None)
        except Exception:
            version = None
        extra = engine_extra(server_args, version)
        extra["dp_rank"] = dp_rank  # which DP group's leader wrote a dump (None without DP)
        return cls(
            cfg, torch, model, num_layers, hidden, dtype, device, extra, attention_tp_size(server_args)
        )

    # ---- hooks ------------------------------------------------------------------------------------

    def attach(self, model: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        layers, norm = find_decoder(model)
        if len(layers) != self.num_layers:
            raise RuntimeError(f"hsx: model has {len(layers)} decoder layers, config says {self.num_layers}")
        if self.attention_tp > 1:
            # The model's own word on its layout (the launcher judged from the config): a tapped layer whose
            # output stays split over the attention-TP ranks leaves this leader only its share of the rows.
            split = scattered_taps(layers, [*self.aux, self.num_layers - 1])
            if split:
                raise RuntimeError(
                    f"hsx: layers {split} leave their output SCATTERED over {self.attention_tp} attention-TP "
                    "ranks: this leader would hold only its share of their rows; refusing to capture"
                )
        slot = 0
        for layer_id in self.aux:
            hook = functools.partial(self._layer_pre_hook, slot)
            self._hooks.append(layers[layer_id + 1].register_forward_pre_hook(hook, with_kwargs=True))
            slot += 1
        if self.final_state in ("post", "both"):
            hook = functools.partial(self._norm_hook, slot)
            self._hooks.append(norm.register_forward_hook(hook))
            slot += 1
        if self.final_state in ("pre", "both"):
            hook = functools.partial(self._norm_pre_hook, slot)
            self._hooks.append(norm.register_forward_pre_hook(hook, with_kwargs=True))
            slot += 1
        assert slot == self.K
        self.model = model

    def _layer_pre_hook(self, k: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        active = self.active
        if active is None:
            return None
        try:
            sig = self._sigs.get(type(module))
            if sig is None:
                sig = self._sigs[type(module)] = inspect.signature(module.forward)
            params = sig.bind_partial(*args, **kwargs).arguments
            if "hidden_states" in params:
                hs, res = params["hidden_states"], params.get("residual")
            else:  # (positions, hidden_states, forward_batch, residual)
                hs, res = args[1], args[3] if len(args) > 3 else None
            self._emit(active, k, hs, res)
        except Exception as exc:
            active.error = active.error or f"{self.names[k]}: {exc}"
        return None

    def _norm_pre_hook(self, k: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        active = self.active
        if active is None:
            return None
        try:
            x, res, extra = _norm_inputs(args, kwargs)
            self._emit(active, k, x, res, extra)
        except Exception as exc:
            active.error = active.error or f"{self.names[k]}: {exc}"
        return None

    def _norm_hook(self, k: int, module: Any, args: tuple[Any, ...], out: Any) -> None:
        active = self.active
        if active is None:
            return None
        try:
            self._emit(active, k, out[0] if isinstance(out, (tuple, list)) else out, None)
        except Exception as exc:
            active.error = active.error or f"{self.names[k]}: {exc}"
        return None

    def _emit(self, active: ActivePlan, k: int, a: Any, b: Any, c: Any = None) -> None:
        """Queue the captured rows of one tensor (``a + b + c``) for the device-to-host copy."""
        if active.fired[k]:
            raise RuntimeError("hook fired twice in one forward")
        active.fired[k] = 1
        for t in (a, b, c):
            if t is not None and pending_reduction(t):
                raise RuntimeError(
                    f"the hooked tensor is tagged {NEEDS_ALLREDUCE_TAG}: its all-reduce has not run yet, so "
                    "this rank holds a partial sum (all-reduce fusion is on); capture dropped"
                )
        plan = active.plan
        if a.dim() != 2 or a.shape[0] < plan.batch_rows or a.shape[1] != self.hidden_size:
            raise RuntimeError(f"unexpected hidden state shape {tuple(a.shape)} for {plan.batch_rows} rows")
        if a.dtype != self.dtype:
            raise RuntimeError(f"hidden state dtype {a.dtype}, expected {self.dtype}")
        torch = self.torch
        # Materialise the rows now: the next layer's fused add-norm updates hidden_states/residual in
        # place, and later ops may reuse the final norm's output.
        srcs = []
        for row, n, cap in plan.spans:
            s = a[row : row + n]
            if b is not None:
                s = torch.add(s, b[row : row + n])
                if c is not None:
                    s = s.add_(c[row : row + n])
            else:
                s = s.clone()
            bad = torch.logical_not(torch.isfinite(s)).sum(dim=1, dtype=torch.int32)
            srcs.append((s, bad, cap, n))
        dst, nf = active.dst[k], active.non_finite[k]
        if self.cuda:
            stream = self.copy_stream
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream(a.device))
            with torch.cuda.stream(stream):
                for s, bad, cap, n in srcs:
                    dst[cap : cap + n].copy_(s, non_blocking=True)
                    nf[cap : cap + n].copy_(bad, non_blocking=True)
                    s.record_stream(stream)  # keep the device rows alive until the copy ran
                    bad.record_stream(stream)
        else:
            for s, bad, cap, n in srcs:
                dst[cap : cap + n].copy_(s)
                nf[cap : cap + n].copy_(bad)

    # ---- scheduler thread -------------------------------------------------------------------------

    def begin(self, worker: Any, batch: Any) -> ActivePlan | None:
        t0 = time.perf_counter()
        try:
            model = worker.model_runner.model
            if model is not self.model:  # weights were reloaded into a new module
                self.attach(model)
            mode = getattr(getattr(batch, "forward_mode", None), "name", "")
            if mode not in ("EXTEND", "MIXED"):
                return None
            plan = self.planner.plan(batch.reqs, batch.prefix_lens, batch.extend_lens)
            return None if plan is None else self._stage(plan)
        except Exception:
            log.exception("hsx: planning a capture failed; this forward is not captured")
            return None
        finally:
            self.sched_s += time.perf_counter() - t0

    def _stage(self, plan: Plan) -> ActivePlan:
        """Reserve the pinned slice of a plan: the rows of every tensor, then their non-finite counts."""
        torch = self.torch
        data = self.K * plan.rows * self.row_bytes
        data_padded = -(-data // 8) * 8
        block, u8 = self.arena.acquire(data_padded + self.K * plan.rows * 4)
        rows_u8 = u8[:data].view(self.K, plan.rows, self.row_bytes)
        counts = u8[data_padded : data_padded + self.K * plan.rows * 4].view(torch.int32)
        return ActivePlan(
            plan,
            block,
            rows_u8,
            rows_u8.view(self.dtype),
            counts.view(self.K, plan.rows),
            [0] * self.K,
        )

    def finish(self, active: ActivePlan, failed: str | None = None) -> None:
        t0 = time.perf_counter()
        plan = active.plan
        error = failed or active.error
        if error is None and not all(active.fired):
            error = f"hooks fired {active.fired}: forward did not run the hooked modules (CUDA graph?)"
        event = None
        if self.cuda:
            event = self.torch.cuda.Event()
            event.record(self.copy_stream)
        job = Job(event, active.block, active.u8, active.non_finite, len(plan.pieces))
        if error is not None:
            log.error("hsx: capture of %d request(s) failed: %s", len(plan.pieces), error)
            self.stats.add(errors=len(plan.pieces))
            self.planner.fail(plan)
            self.writer.release(job)
        else:
            self.writer.submit(job, plan.pieces)
            self.stats.add(forwards=1)
        self.sched_s += time.perf_counter() - t0

    def sweep(self) -> None:
        self.planner.sweep()

    def flush(self, timeout: float = 60.0) -> bool:
        return self.writer.flush(timeout)

    def _make_meta(self, req: Any, st: ReqState) -> contract.DumpMeta:
        extra = dict(self.engine_extra)
        extra.update(start=st.start, chunks=st.chunks, extra_key=getattr(req, "extra_key", None))
        return contract.DumpMeta(
            rid=req.rid,
            num_tokens=st.total,
            prompt_tokens=len(req.origin_input_ids),
            cached_tokens=int(getattr(req, "cached_tokens", 0) or 0),
            hidden_size=self.hidden_size,
            dtype=self.dtype_name,
            num_layers=self.num_layers,
            aux_layer_ids=list(self.aux),
            hf_indices=list(self.hf),
            engine=ENGINE_NAME,
            extra=extra,
        )

    def _stats_loop(self) -> None:
        last: dict[str, int] = {}
        while True:
            time.sleep(self.cfg.stats_seconds)
            now = self.stats.snapshot()
            now["dropped"] += self.planner.dropped
            if now != last:
                log.info(
                    "hsx stats: %s partials=%d sched_cpu_s=%.2f backpressure_s=%.2f oversize=%d",
                    " ".join(f"{k}={v}" for k, v in now.items()),
                    len(self.planner.partials),
                    self.sched_s,
                    self.arena.wait_s,
                    self.arena.oversize,
                )
                last = now
