"""Hidden-state capture inside a stock SGLang (0.5.17) scheduler process.

The launcher passes :func:`run_scheduler_process` to ``launch_server(run_scheduler_process_func=...)``;
SGLang *spawns* every scheduler with it, so the patches below are applied in the process that runs the
model. On TP rank 0 only (every TP rank holds the same residual stream) it

* wraps ``TpModelWorker.__init__`` to attach forward hooks to the loaded model: a pre-hook on decoder
  layer ``L + 1`` for every aux layer ``L`` (``hidden_states + residual`` entering it is the output of
  layer ``L``, HF ``hidden_states[L + 1]``) and a forward hook on the final norm (HF ``hidden_states[N]``);
* wraps ``TpModelWorker.forward_batch_generation``: before an EXTEND/MIXED forward it plans which rows of
  the batch belong to captured requests (rid starting with ``contract.RID_PREFIX``, prompt rows only,
  placed by ``prefix_lens``/``extend_lens``), reserves a slice of one pinned host arena, and lets the hooks
  copy exactly those rows device-to-host on a side stream (``non_blocking``, no sync of the forward
  stream); after the forward it records a CUDA event and hands the rows to writer threads;
* wraps ``Scheduler.abort_request`` / ``process_pending_chunked_abort`` to drop partial captures of
  aborted requests.

Writer threads wait for the event, reassemble chunked prefills in order (``prefix_lens`` offsets) and
write ``<dump_dir>/<rid>/states.safetensors`` from the raw bytes (``contract.write_safetensors``, no
pickle), then ``meta.json`` last (``contract.write_meta_atomically``). A request whose prompt arrives in
one forward is written straight from the pinned arena; a chunked one is gathered in a pageable buffer.

Only ``hsx.contract`` is imported from hsx; torch and sglang are imported lazily (this module is also
imported by the launcher process, which must stay light).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
import queue
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hsx import contract

log = logging.getLogger("hsx.sglang")

ENGINE_NAME = "sglang"

# Plugin configuration, passed from the launcher to the spawned schedulers through the environment.
ENV_DUMP_DIR = "HSX_SGLANG_DUMP_DIR"
ENV_AUX_LAYERS = "HSX_SGLANG_AUX_LAYERS"  # comma-separated decoder layer ids; empty: EAGLE-3 default
ENV_PINNED_MB = "HSX_SGLANG_PINNED_MB"  # pinned host staging arena (TP rank 0 only)
ENV_WRITERS = "HSX_SGLANG_WRITER_THREADS"
ENV_STATS_SECONDS = "HSX_SGLANG_STATS_SECONDS"  # period of the stats log line; 0 disables it

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass
class PluginConfig:
    dump_dir: str
    aux_layer_ids: list[int] | None = None
    pinned_mb: int = 2048
    writer_threads: int = 4
    stats_seconds: float = 30.0

    def to_env(self) -> dict[str, str]:
        return {
            ENV_DUMP_DIR: self.dump_dir,
            ENV_AUX_LAYERS: ",".join(str(x) for x in self.aux_layer_ids or []),
            ENV_PINNED_MB: str(self.pinned_mb),
            ENV_WRITERS: str(self.writer_threads),
            ENV_STATS_SECONDS: str(self.stats_seconds),
        }

    @classmethod
    def from_env(cls, env: Any = None) -> PluginConfig:
        env = os.environ if env is None else env
        dump_dir = env.get(ENV_DUMP_DIR, "")
        if not dump_dir:
            raise RuntimeError(
                f"hsx sglang plugin: {ENV_DUMP_DIR} is not set; start the server with "
                "`python -m workers.engines.sglang.launcher` (or `hsx engine --backend sglang`)"
            )
        aux = [int(x) for x in env.get(ENV_AUX_LAYERS, "").split(",") if x.strip()]
        return cls(
            dump_dir=dump_dir,
            aux_layer_ids=aux or None,
            pinned_mb=int(env.get(ENV_PINNED_MB, "2048")),
            writer_threads=max(1, int(env.get(ENV_WRITERS, "4"))),
            stats_seconds=float(env.get(ENV_STATS_SECONDS, "30")),
        )


def unsupported_config(server_args: Any) -> list[str]:
    """Server configurations under which the hooks would capture wrong rows; empty when fine.

    Shared by the launcher (fail before launching) and the scheduler processes (defence in depth).
    """
    problems: list[str] = []

    def get(name: str, default: Any = None) -> Any:
        return getattr(server_args, name, default)

    if get("is_embedding"):
        problems.append("embedding models (--is-embedding)")
    if (get("pp_size") or 1) > 1:
        problems.append(
            "pipeline parallelism (--pp-size > 1): aux layers and final norm live on different ranks"
        )
    if get("enable_dp_attention"):
        problems.append("DP attention (--enable-dp-attention): per-rank batches are padded and gathered")
    if (get("attn_cp_size") or 1) > 1 or (get("dcp_size") or 1) > 1:
        problems.append("context parallelism: a request's tokens are split across ranks")
    if get("speculative_algorithm"):
        problems.append("speculative decoding: the target forward runs as verify passes")
    if get("enable_pdmux"):
        problems.append("--enable-pdmux: split prefill bypasses forward_batch_generation")
    if get("enable_two_batch_overlap") or get("enable_single_batch_overlap"):
        problems.append("two/single batch overlap: layers run on micro-batches")
    if get("enable_torch_compile"):
        problems.append("--enable-torch-compile: module hooks inside a compiled graph")
    if get("dllm_algorithm"):
        problems.append("diffusion LLMs")
    mode = get("disaggregation_mode")
    if mode not in (None, "null"):
        problems.append(f"PD disaggregation (--disaggregation-mode {mode})")
    cfg = get("cuda_graph_config")
    prefill = getattr(getattr(cfg, "prefill", None), "backend", None)
    if prefill is not None and str(prefill) != "disabled":
        problems.append(
            f"prefill CUDA graph backend {prefill!r}: hooks do not run on graph replay "
            "(use --cuda-graph-backend-prefill disabled; the launcher adds it by default)"
        )
    return problems


# --------------------------------------------------------------------------------------------------
# Entry point (spawned scheduler process)
# --------------------------------------------------------------------------------------------------

_CAPTURE: _Capture | None = None
_INSTALL: dict[str, Any] = {}


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """Drop-in for ``sglang.srt.managers.scheduler.run_scheduler_process``: patch, then run it."""
    from sglang.srt.managers import scheduler as scheduler_mod

    orig = scheduler_mod.run_scheduler_process
    bound = inspect.signature(orig).bind(*args, **kwargs)
    server_args = bound.arguments["server_args"]
    tp_rank = int(bound.arguments.get("tp_rank", 0) or 0)
    cfg = PluginConfig.from_env()
    problems = unsupported_config(server_args)
    if problems:
        raise RuntimeError("hsx sglang plugin cannot capture with: " + "; ".join(problems))
    if tp_rank == 0:
        _install(cfg, server_args)
    return orig(*args, **kwargs)


def _install(cfg: PluginConfig, server_args: Any) -> None:
    """Patch the SGLang classes of this process (TP rank 0)."""
    if _INSTALL:
        return
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker

    _INSTALL.update(cfg=cfg, server_args=server_args)

    orig_init = TpModelWorker.__init__
    orig_fbg = TpModelWorker.forward_batch_generation

    @functools.wraps(orig_init)
    def init(self: Any, *a: Any, **k: Any) -> None:
        orig_init(self, *a, **k)
        global _CAPTURE
        if _CAPTURE is None and not getattr(self, "is_draft_worker", False):
            _CAPTURE = _Capture.create(cfg, self.model_runner, server_args)

    @functools.wraps(orig_fbg)
    def forward_batch_generation(self: Any, batch: Any = None, *a: Any, **k: Any) -> Any:
        cap = _CAPTURE
        if cap is None or batch is None:
            return orig_fbg(self, batch, *a, **k)
        plan = cap.begin(self, batch)
        if plan is None:
            return orig_fbg(self, batch, *a, **k)
        cap.active = plan
        try:
            result = orig_fbg(self, batch, *a, **k)
        except BaseException:
            cap.active = None
            cap.finish(plan, failed="the forward raised")
            raise
        cap.active = None
        cap.finish(plan)
        return result

    TpModelWorker.__init__ = init
    TpModelWorker.forward_batch_generation = forward_batch_generation

    for name in ("abort_request", "process_pending_chunked_abort"):
        orig = getattr(Scheduler, name, None)
        if orig is None:
            log.warning("hsx: Scheduler.%s not found; aborted partial captures are swept per forward", name)
            continue
        setattr(Scheduler, name, _after_sweep(orig))


def _after_sweep(orig: Any) -> Any:
    @functools.wraps(orig)
    def wrapped(self: Any, *a: Any, **k: Any) -> Any:
        out = orig(self, *a, **k)
        cap = _CAPTURE
        if cap is not None:
            try:
                cap.sweep()
            except Exception:  # never take the scheduler down for bookkeeping
                log.exception("hsx: sweep after %s failed", getattr(orig, "__name__", "?"))
        return out

    return wrapped


# --------------------------------------------------------------------------------------------------
# Pinned host staging arena
# --------------------------------------------------------------------------------------------------


class _Arena:
    """One pinned buffer handed out as a ring: blocks are allocated in order and freed in any order.

    ``acquire`` blocks while the ring is full (the writers are behind): that is the backpressure that
    keeps host memory bounded. A block larger than the whole ring gets a one-off pinned tensor.
    """

    ALIGN = 4096

    def __init__(self, torch: Any, nbytes: int, pin: bool) -> None:
        self.torch = torch
        self.pin = pin
        self.size = max(self.ALIGN, nbytes // self.ALIGN * self.ALIGN)
        self.buf = torch.empty(self.size, dtype=torch.uint8, pin_memory=pin)
        self.live: deque[list[Any]] = deque()  # [offset, size, freed]
        self.cv = threading.Condition()
        self.wait_s = 0.0
        self.oversize = 0

    def _fit(self, n: int) -> int | None:
        if not self.live:
            return 0
        first, last = self.live[0], self.live[-1]
        head = int(last[0] + last[1])
        if last[0] >= first[0]:  # not wrapped: [head, size) then [0, first)
            if head + n <= self.size:
                return head
            if n <= first[0]:
                return 0
            return None
        return head if head + n <= first[0] else None

    def acquire(self, nbytes: int) -> tuple[list[Any] | None, Any]:
        n = max(self.ALIGN, -(-nbytes // self.ALIGN) * self.ALIGN)
        if n > self.size:
            self.oversize += 1
            return None, self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=self.pin)
        with self.cv:
            off = self._fit(n)
            if off is None:
                t0 = time.perf_counter()
                while off is None:
                    self.cv.wait()
                    off = self._fit(n)
                self.wait_s += time.perf_counter() - t0
            rec = [off, n, False]
            self.live.append(rec)
        return rec, self.buf[off : off + nbytes]

    def release(self, rec: list[Any] | None) -> None:
        if rec is None:
            return
        with self.cv:
            rec[2] = True
            while self.live and self.live[0][2]:
                self.live.popleft()
            self.cv.notify_all()


# --------------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------------


class _ReqState:
    """Per-request capture progress, kept on the ``Req`` object (scheduler thread only)."""

    __slots__ = ("token", "start", "next", "total", "chunks", "closed")

    def __init__(self, token: int, start: int, total: int) -> None:
        self.token = token
        self.start = start  # first prompt position captured (> 0 only on a prefix-cache hit)
        self.next = start  # next prompt position expected
        self.total = total  # rows of the finished dump
        self.chunks = 0
        self.closed = False  # written, failed or aborted: ignore further rows


@dataclass
class _Piece:
    rid: str
    token: int
    cap_off: int  # first row in the job buffer
    n: int
    dst_off: int  # first row in the dump
    total: int
    ids: bytes  # int32 input ids of these rows
    meta: contract.DumpMeta | None  # set on the piece that completes the prompt
    state: Any = None  # the request's _ReqState (scheduler thread only)


@dataclass
class _Plan:
    pieces: list[_Piece]
    spans: list[list[int]]  # [batch_row, n, cap_off]: contiguous captured rows
    total_rows: int
    rows: int
    rec: list[Any] | None
    u8: Any  # pinned uint8 [K, rows, H * itemsize]
    dst: Any  # the same memory as the model dtype [K, rows, H]
    fired: list[int]
    error: str | None = None


@dataclass
class _Job:
    event: Any
    rec: list[Any] | None
    u8: Any
    remaining: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    synced: bool = False

    def wait(self) -> None:
        if not self.synced:
            if self.event is not None:
                self.event.synchronize()
            self.synced = True


@dataclass
class _Partial:
    token: int
    buf: Any  # pageable uint8 [K, total, H * itemsize]
    ids: bytearray
    filled: int = 0


class _Capture:
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
    ) -> None:
        self.torch = torch
        self.cfg = cfg
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.dtype_name = str(dtype).replace("torch.", "")
        if self.dtype_name not in SAFETENSORS_DTYPES:
            raise RuntimeError(f"hsx: unsupported hidden-state dtype {dtype}")
        self.st_dtype = SAFETENSORS_DTYPES[self.dtype_name]
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = hidden_size * self.itemsize
        self.aux = list(cfg.aux_layer_ids or contract.eagle3_aux_layer_ids(num_layers))
        self.hf = contract.hf_indices(self.aux, num_layers)
        self.K = len(self.hf)
        self.dump_dir = cfg.dump_dir
        os.makedirs(self.dump_dir, exist_ok=True)
        self.engine_extra = dict(engine_extra or {})
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.arena = _Arena(torch, cfg.pinned_mb << 20, pin=self.cuda)
        self.active: _Plan | None = None
        self.model: Any = None
        self._hooks: list[Any] = []
        self._sigs: dict[type, inspect.Signature] = {}
        self._tokens = itertools.count(1)
        self._partials: dict[int, Any] = {}  # token -> Req with a capture in progress
        self.stats = {"dumps": 0, "rows": 0, "bytes": 0, "dropped": 0, "errors": 0, "forwards": 0}
        self.sched_s = 0.0
        self._stats_lock = threading.Lock()
        self._queues: list[queue.SimpleQueue[Any]] = []
        self._parts: list[dict[str, _Partial]] = []
        for i in range(cfg.writer_threads):
            q: queue.SimpleQueue[Any] = queue.SimpleQueue()
            self._queues.append(q)
            self._parts.append({})
            threading.Thread(target=self._writer, args=(i,), name=f"hsx-writer-{i}", daemon=True).start()
        if cfg.stats_seconds > 0:
            threading.Thread(target=self._stats_loop, name="hsx-stats", daemon=True).start()
        self.attach(model)
        log.info(
            "hsx capture on: layers=%d hidden=%d dtype=%s aux=%s hf=%s dump_dir=%s arena=%d MiB writers=%d",
            num_layers,
            hidden_size,
            self.dtype_name,
            self.aux,
            self.hf,
            self.dump_dir,
            self.arena.size >> 20,
            cfg.writer_threads,
        )

    @classmethod
    def create(cls, cfg: PluginConfig, model_runner: Any, server_args: Any) -> _Capture:
        import torch

        model = model_runner.model
        text_cfg = getattr(model_runner.model_config, "hf_text_config", None) or model.config
        num_layers = int(text_cfg.num_hidden_layers)
        hidden = int(text_cfg.hidden_size)
        dtype = getattr(model_runner, "dtype", None) or next(model.parameters()).dtype
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        try:
            import sglang

            version = getattr(sglang, "__version__", "")
        except Exception:
            version = ""
        extra = {"engine_version": version, "tp_size": int(getattr(server_args, "tp_size", 1) or 1)}
        return cls(cfg, torch, model, num_layers, hidden, dtype, device, engine_extra=extra)

    # ---- hooks ------------------------------------------------------------------------------------

    @staticmethod
    def _find_decoder(model: Any) -> tuple[Any, Any]:
        for path in ("model", "language_model.model", "language_model", "transformer", ""):
            obj = model
            for part in filter(None, path.split(".")):
                obj = getattr(obj, part, None)
            layers = getattr(obj, "layers", None)
            norm = getattr(obj, "norm", None)
            if layers is not None and norm is not None:
                return layers, norm
        raise RuntimeError(f"hsx: cannot find decoder layers and final norm in {type(model).__name__}")

    def attach(self, model: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        layers, norm = self._find_decoder(model)
        if len(layers) != self.num_layers:
            raise RuntimeError(f"hsx: model has {len(layers)} decoder layers, config says {self.num_layers}")
        for k, layer_id in enumerate(self.aux):
            hook = functools.partial(self._pre_hook, k)
            self._hooks.append(layers[layer_id + 1].register_forward_pre_hook(hook, with_kwargs=True))
        self._hooks.append(norm.register_forward_hook(functools.partial(self._norm_hook, self.K - 1)))
        self.model = model

    def _pre_hook(self, k: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        plan = self.active
        if plan is None:
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
            self._emit(plan, k, hs, res)
        except Exception as exc:
            plan.error = plan.error or f"aux hook {k}: {exc!r}"
        return None

    def _norm_hook(self, k: int, module: Any, args: tuple[Any, ...], out: Any) -> None:
        plan = self.active
        if plan is None:
            return None
        try:
            self._emit(plan, k, out[0] if isinstance(out, (tuple, list)) else out, None)
        except Exception as exc:
            plan.error = plan.error or f"norm hook: {exc!r}"
        return None

    def _emit(self, plan: _Plan, k: int, a: Any, b: Any) -> None:
        """Queue the captured rows of one layer for device-to-host copy into the plan's pinned slice."""
        if plan.fired[k]:
            plan.error = plan.error or f"hook {k} fired twice in one forward"
            return
        plan.fired[k] = 1
        if a.dim() != 2 or a.shape[0] < plan.total_rows or a.shape[1] != self.hidden_size:
            raise RuntimeError(f"unexpected hidden state shape {tuple(a.shape)} for {plan.total_rows} rows")
        if a.dtype != self.dtype:
            raise RuntimeError(f"hidden state dtype {a.dtype}, expected {self.dtype}")
        torch = self.torch
        # Materialise the rows now: the next layer's fused add-norm updates hidden_states/residual in
        # place, and later ops may reuse the final norm's output.
        srcs = []
        for row, n, cap in plan.spans:
            s = a[row : row + n]
            s = torch.add(s, b[row : row + n]) if b is not None else s.clone()
            srcs.append((s, cap, n))
        dst = plan.dst[k]
        if self.cuda:
            stream = self.copy_stream
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream(a.device))
            with torch.cuda.stream(stream):
                for s, cap, n in srcs:
                    dst[cap : cap + n].copy_(s, non_blocking=True)
                    s.record_stream(stream)  # keep the device rows alive until the copy ran
        else:
            for s, cap, n in srcs:
                dst[cap : cap + n].copy_(s)

    # ---- scheduler thread -------------------------------------------------------------------------

    def begin(self, worker: Any, batch: Any) -> _Plan | None:
        t0 = time.perf_counter()
        try:
            model = worker.model_runner.model
            if model is not self.model:  # weights were reloaded into a new module
                self.attach(model)
            return self._plan(batch)
        except Exception:
            log.exception("hsx: planning a capture failed; this forward is not captured")
            return None
        finally:
            self.sched_s += time.perf_counter() - t0

    def _plan(self, batch: Any) -> _Plan | None:
        mode = getattr(getattr(batch, "forward_mode", None), "name", "")
        if mode not in ("EXTEND", "MIXED"):
            return None
        if self._partials:
            self.sweep()
        reqs = batch.reqs
        prefix_lens, extend_lens = batch.prefix_lens, batch.extend_lens
        if (
            prefix_lens is None
            or extend_lens is None
            or not (len(reqs) == len(prefix_lens) == len(extend_lens))
        ):
            log.error("hsx: batch without prefix_lens/extend_lens for every request; not captured")
            return None
        pieces: list[_Piece] = []
        spans: list[list[int]] = []
        row = rows = 0
        for req, pre, ext in zip(reqs, prefix_lens, extend_lens, strict=True):
            pre, ext = int(pre), int(ext)
            if contract.is_captured_rid(getattr(req, "rid", None)):
                piece = self._piece(req, pre, ext, rows)
                if piece is not None:
                    if spans and spans[-1][0] + spans[-1][1] == row and spans[-1][2] + spans[-1][1] == rows:
                        spans[-1][1] += piece.n
                    else:
                        spans.append([row, piece.n, rows])
                    pieces.append(piece)
                    rows += piece.n
            row += ext
        if not pieces:
            return None
        rec, u8 = self.arena.acquire(self.K * rows * self.row_bytes)
        u8 = u8.view(self.K, rows, self.row_bytes)
        dst = u8.view(self.dtype)
        return _Plan(pieces, spans, row, rows, rec, u8, dst, [0] * self.K)

    def _piece(self, req: Any, pre: int, ext: int, cap_off: int) -> _Piece | None:
        st: _ReqState | None = getattr(req, "_hsx_cap", None)
        if st is not None and st.closed:
            return None
        if req.finished() or getattr(req, "to_finish", None) is not None:
            # Aborted (or about to be: set_finish_with_abort swaps the prompt for one token).
            if st is not None:
                self._drop(req, st, "finished before its prompt was complete")
            return None
        ids_all = req.origin_input_ids
        plen = len(ids_all)
        n = min(pre + ext, plen) - pre
        if n <= 0:
            return None  # a decode row of a request whose prompt is done
        if st is None or pre != st.next:
            if st is not None:
                self._drop(req, st, f"prefill restarted at {pre}, expected {st.next}")
            st = _ReqState(next(self._tokens), pre, plen - pre)
            req._hsx_cap = st
        import numpy as np

        ids = np.asarray(ids_all[pre : pre + n], dtype=np.int64).astype("<i4").tobytes()
        piece = _Piece(req.rid, st.token, cap_off, n, pre - st.start, st.total, ids, None, st)
        st.next = pre + n
        st.chunks += 1
        if st.next == plen:
            st.closed = True
            self._partials.pop(st.token, None)
            extra = dict(self.engine_extra)
            extra.update(start=st.start, chunks=st.chunks, extra_key=getattr(req, "extra_key", None))
            piece.meta = contract.DumpMeta(
                rid=req.rid,
                num_tokens=st.total,
                prompt_tokens=plen,
                cached_tokens=int(getattr(req, "cached_tokens", 0) or 0),
                hidden_size=self.hidden_size,
                dtype=self.dtype_name,
                num_layers=self.num_layers,
                aux_layer_ids=list(self.aux),
                hf_indices=list(self.hf),
                engine=ENGINE_NAME,
                extra=extra,
            )
        else:
            self._partials[st.token] = req
        return piece

    def _drop(self, req: Any, st: _ReqState, reason: str) -> None:
        st.closed = True
        self._partials.pop(st.token, None)
        self._queue_for(req.rid).put(("drop", req.rid, st.token))
        with self._stats_lock:
            self.stats["dropped"] += 1
        log.warning(
            "hsx: dropped partial capture of %s (%s; %d of %d rows captured)",
            req.rid,
            reason,
            st.next - st.start,
            st.total,
        )

    def sweep(self) -> None:
        """Drop the partial captures of requests that finished (were aborted) mid-prefill."""
        for token, req in list(self._partials.items()):
            st = getattr(req, "_hsx_cap", None)
            if st is None or st.token != token or st.closed:
                self._partials.pop(token, None)
            elif req.finished() or getattr(req, "to_finish", None) is not None:
                self._drop(req, st, "aborted")

    def finish(self, plan: _Plan, failed: str | None = None) -> None:
        t0 = time.perf_counter()
        error = failed or plan.error
        if error is None and not all(plan.fired):
            error = f"hooks fired {plan.fired}: forward did not run the hooked modules (CUDA graph?)"
        event = None
        if self.cuda:
            event = self.torch.cuda.Event()
            event.record(self.copy_stream)
        if error is not None:
            log.error("hsx: capture of %d request(s) failed: %s", len(plan.pieces), error)
            with self._stats_lock:
                self.stats["errors"] += len(plan.pieces)
            for p in plan.pieces:
                if p.state is not None:
                    p.state.closed = True  # later chunks of these requests are not captured either
                self._queue_for(p.rid).put(("drop", p.rid, p.token))
                self._partials.pop(p.token, None)
            self._queues[0].put(("release", _Job(event, plan.rec, plan.u8, 0)))
        else:
            job = _Job(event, plan.rec, plan.u8, len(plan.pieces))
            for p in plan.pieces:
                self._queue_for(p.rid).put(("piece", job, p))
            with self._stats_lock:
                self.stats["forwards"] += 1
        self.sched_s += time.perf_counter() - t0

    def _queue_for(self, rid: str) -> queue.SimpleQueue[Any]:
        return self._queues[hash(rid) % len(self._queues)]

    # ---- writer threads ---------------------------------------------------------------------------

    def _writer(self, index: int) -> None:
        q, parts = self._queues[index], self._parts[index]
        while True:
            msg = q.get()
            kind = msg[0]
            try:
                if kind == "piece":
                    self._write_piece(parts, msg[1], msg[2])
                elif kind == "drop":
                    part = parts.get(msg[1])
                    if part is not None and part.token == msg[2]:
                        del parts[msg[1]]
                elif kind == "release":
                    msg[1].wait()
                    self.arena.release(msg[1].rec)
                elif kind == "stop":
                    return
            except Exception:
                log.exception("hsx: writer %d failed on %s", index, kind)
                with self._stats_lock:
                    self.stats["errors"] += 1

    def _write_piece(self, parts: dict[str, _Partial], job: _Job, p: _Piece) -> None:
        try:
            job.wait()
            if p.dst_off == 0 and p.n == p.total and p.meta is not None:
                layers = [job.u8[k, p.cap_off : p.cap_off + p.n] for k in range(self.K)]
                self._write_dump(p.rid, p.meta, p.ids, layers)
                return
            part = parts.get(p.rid)
            if p.dst_off == 0:
                part = _Partial(
                    p.token,
                    self.torch.empty((self.K, p.total, self.row_bytes), dtype=self.torch.uint8),
                    bytearray(4 * p.total),
                )
                parts[p.rid] = part
            elif part is None or part.token != p.token or part.filled != p.dst_off:
                if part is not None and part.token == p.token:
                    del parts[p.rid]
                log.error("hsx: chunk of %s at row %d out of order; capture dropped", p.rid, p.dst_off)
                with self._stats_lock:
                    self.stats["errors"] += 1
                return
            part.buf[:, p.dst_off : p.dst_off + p.n].copy_(job.u8[:, p.cap_off : p.cap_off + p.n])
            part.ids[4 * p.dst_off : 4 * (p.dst_off + p.n)] = p.ids
            part.filled += p.n
            if p.meta is not None:
                del parts[p.rid]
                if part.filled != p.total:
                    raise RuntimeError(f"{p.rid}: {part.filled} of {p.total} rows at the last chunk")
                self._write_dump(p.rid, p.meta, bytes(part.ids), [part.buf[k] for k in range(self.K)])
        finally:
            with job.lock:
                job.remaining -= 1
                done = job.remaining == 0
            if done:
                self.arena.release(job.rec)

    def _write_dump(self, rid: str, meta: contract.DumpMeta, ids: bytes, layers: list[Any]) -> None:
        directory = contract.dump_path(self.dump_dir, rid)
        if os.path.isdir(directory):
            # A request resent under the same rid replaces the earlier dump (as the reference engine does);
            # a re-prefill of the same request never gets here (its capture is closed).
            shutil.rmtree(directory)
        T, H = meta.num_tokens, self.hidden_size
        tensors: list[tuple[str, str, list[int], Any]] = [("input_ids", "I32", [T], ids)]
        for hf_index, layer in zip(self.hf, layers, strict=True):
            # raw little-endian bytes of the rows, straight from the (pinned) host buffer: no copy, no pickle
            tensors.append(
                (contract.tensor_name(hf_index), self.st_dtype, [T, H], layer.reshape(-1).numpy().data)
            )
        try:
            os.makedirs(directory, exist_ok=True)
            contract.write_safetensors(os.path.join(directory, contract.STATES_FILE), tensors)
            contract.write_meta_atomically(directory, meta)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)  # no half dump
            raise
        with self._stats_lock:
            self.stats["dumps"] += 1
            self.stats["rows"] += T
            self.stats["bytes"] += T * (4 + self.K * self.row_bytes)

    def _stats_loop(self) -> None:
        last: dict[str, int] = {}
        while True:
            time.sleep(self.cfg.stats_seconds)
            with self._stats_lock:
                now = dict(self.stats)
            if now != last:
                log.info(
                    "hsx stats: %s partials=%d sched_cpu_s=%.2f backpressure_s=%.2f oversize=%d",
                    " ".join(f"{k}={v}" for k, v in now.items()),
                    len(self._partials),
                    self.sched_s,
                    self.arena.wait_s,
                    self.arena.oversize,
                )
                last = now

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the writers have drained their queues (tests)."""
        done = threading.Event()
        pending = [len(self._queues)]
        lock = threading.Lock()

        def mark() -> None:
            with lock:
                pending[0] -= 1
                if pending[0] == 0:
                    done.set()

        for q in self._queues:
            q.put(("release", _FlushJob(mark)))
        return done.wait(timeout)


class _FlushJob:
    rec = None

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def wait(self) -> None:
        self.callback()
