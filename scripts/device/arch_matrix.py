"""The SGLang capture across architectures, in one device call (run by ``run_arch_matrix.sh``).

    arch_matrix.py --out DIR --deadline EPOCH_SECONDS [--archs llama,qwen3,...]

For every architecture of ``arch_models.ARCHS`` (each in its own try; a failure is recorded and the rest
go on): a random-init checkpoint, a patched SGLang server (``--disable-radix-cache``, chunked prefill
256, ``--final-state`` pre or both), and traffic mixing captured rids, plain-rid copies and
``/health_generate`` calls, all at once so that they share chunked, mixed batches. Each dump is checked
for exact counts and ids, and compared per tensor with transformers on the same weights in bf16 and fp32.

Servers start one after another (the next once the previous has sized its KV pool, so that their memory
profiling does not overlap) while the main thread makes the models and the reference states. At the
deadline, whatever has not finished is stopped and reported as such. Writes ``DIR/matrix.json``,
``DIR/table.md`` and server logs under ``DIR/logs``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import arch_models as am  # noqa: E402
import arch_stats as st  # noqa: E402

from bench.sglang_capture import Client, wait_for_dumps  # noqa: E402
from hsx import contract  # noqa: E402
from workers.engines.sglang.config import dump_tensor_names  # noqa: E402

LENS = [1, 2, 17, 255, 256, 257, 700, 1500]
CHUNK = 256
BASE_PORT = 30100
SERVER_FLAGS = [
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
    "--disable-cuda-graph", "--disable-radix-cache", "--dtype", "bfloat16", "--mem-fraction-static", "0.08",
    "--chunked-prefill-size", str(CHUNK), "--context-length", "4096",
]  # fmt: skip
POOL_MARK = "Memory pool end"  # SGLang's log line once the KV pool is allocated
GPU = "cuda"
# --dry-run-cpu: tiny models on CPU, each served by the reference engine instead of SGLang (it speaks the
# same protocol and takes --final-state); exercises this script end to end where no GPU is.
DRY_RUN = {"on": False}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompts_for(name: str, vocab: int) -> list[list[int]]:
    rng = random.Random(f"matrix-{name}")
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in LENS]


def load_dump(dump_dir: str, rid: str) -> tuple[contract.DumpMeta, dict[str, Any]]:
    import torch

    d = os.path.join(dump_dir, rid)
    with open(os.path.join(d, contract.META_FILE)) as fh:
        meta = contract.DumpMeta.from_json(fh.read())
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32}
    out = {}
    for name, t in contract.read_safetensors(os.path.join(d, contract.STATES_FILE)).items():
        out[name] = torch.frombuffer(bytearray(t.data), dtype=dtypes[t.dtype]).view(*t.shape)
    return meta, out


class ArchRun:
    def __init__(
        self, index: int, name: str, work: str, out: str, dump_root: str = "/dev/shm/hsx-matrix"
    ) -> None:
        self.index, self.name = index, name
        self.port = BASE_PORT + index
        self.model_dir = os.path.join(work, "models", name)
        self.dump_dir = os.path.join(dump_root, name)
        self.log_path = os.path.join(out, "logs", f"server_{name}.log")
        self.final_state = am.FINAL_STATE[name]
        self.model_ready, self.refs_ready, self.pool_done = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.prompts: list[list[int]] = []
        self.refs: dict[str, Any] | None = None
        self.result: dict[str, Any] = {"final_state": self.final_state, "status": "not started"}
        self.t0 = time.monotonic()

    def fail(self, status: str) -> None:
        self.result["status"] = status
        log(f"{self.name}: {status}")

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return ""

    def launch(self) -> None:
        self.t0 = time.monotonic()
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        subprocess.run(["rm", "-rf", self.dump_dir], check=False)
        if DRY_RUN["on"]:
            cmd = [sys.executable, "-m", "workers.engines.reference.cli", "--model", self.model_dir]
            flags = ["--disable-prefix-cache", "--dtype", "bfloat16", "--device", "cpu", "--threads", "1"]
        else:
            cmd = [sys.executable, "-m", "workers.engines.sglang.launcher", "--model-path", self.model_dir]
            flags = SERVER_FLAGS
        cmd += ["--port", str(self.port), "--dump-dir", self.dump_dir, "--final-state", self.final_state]
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(self.log_path, "wb") as fh:
            self.proc = subprocess.Popen(
                cmd + flags,
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        # the wrapper kills these process groups by id if this process itself is killed
        with open(os.path.join(os.path.dirname(self.log_path), "server_pids"), "a") as fh:
            fh.write(f"{self.proc.pid}\n")

    def stop(self, fast: bool = False) -> None:
        """Stop the server's process group (``fast``: at the deadline, SIGKILL at once)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        steps = ((signal.SIGKILL, 5),) if fast else ((signal.SIGTERM, 20), (signal.SIGKILL, 10))
        for sig, wait in steps:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def wait_until(pred: Any, deadline: float, proc: Any = None, step: float = 0.5) -> bool:
    while time.time() < deadline:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(step)
    return False


def serve_and_check(run: ArchRun, prev: ArchRun | None, deadline: float) -> None:
    """One architecture's server: launch in turn, wait until up, send the traffic, check the dumps."""
    try:
        run.model_ready.wait(max(0.0, deadline - time.time()))
        if run.result["status"] != "model ready":
            return
        if prev is not None:
            prev.pool_done.wait(max(0.0, deadline - time.time()))
        if time.time() > deadline - 30:
            return run.fail("not run: time budget")
        run.launch()
        run.result["status"] = "launched"
        gate = time.time() + (240 if prev is None else 120)

        def pool_sized() -> bool:
            return DRY_RUN["on"] or POOL_MARK in run.log_tail(400)

        wait_until(pool_sized, min(gate, deadline), run.proc, 1.0)
        run.pool_done.set()  # the next server may size its pool now (or this one failed: no point waiting)
        client = Client(f"http://127.0.0.1:{run.port}", timeout=120)

        def healthy() -> bool:
            try:
                up = client.request("GET", "/health")[0] == 200
                return up and client.request("GET", contract.INFO_PATH)[0] == 200
            except OSError:
                return False

        if not wait_until(healthy, deadline - 20, run.proc, 1.0):
            run.result["log_tail"] = run.log_tail()
            return run.fail(
                "server did not come up" + (" (died)" if run.proc and run.proc.poll() is not None else "")
            )
        run.result["startup_s"] = round(time.monotonic() - run.t0, 1)
        log(f"{run.name}: server up after {run.result['startup_s']}s")
        if not run.refs_ready.wait(max(0.0, deadline - 15 - time.time())) or run.refs is None:
            return run.fail(run.result.get("ref_error", "not run: reference states not ready in time"))
        check(run, client, deadline)
    except Exception as exc:  # one architecture's failure never stops the others
        run.result["traceback"] = traceback.format_exc()[-2000:]
        run.result["log_tail"] = run.log_tail()
        run.fail(f"error: {exc!r}"[:300])
    finally:
        run.pool_done.set()
        run.stop()


def check(run: ArchRun, client: Client, deadline: float) -> None:
    status, info = client.request("GET", contract.INFO_PATH)
    run.result["info"] = info
    tag = uuid.uuid4().hex[:6]
    jobs: list[tuple[str, Any]] = []
    for i, ids in enumerate(run.prompts):
        jobs.append(("cap", (f"{contract.RID_PREFIX}mx-{run.name}-{i}-{tag}", ids)))
        jobs.append(("plain", (f"plain-mx-{run.name}-{i}-{tag}", ids)))
    jobs += [("health", None)] * 2
    random.Random(7).shuffle(jobs)
    responses: dict[str, Any] = {}

    def send(job: tuple[str, Any]) -> None:
        kind, arg = job
        if kind == "health":
            responses.setdefault("health", []).append(client.request("GET", "/health_generate")[0])
        else:
            responses[arg[0]] = client.generate(arg[1], arg[0])

    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        list(ex.map(send, jobs))
    cap = [arg for kind, arg in jobs if kind == "cap"]
    cap.sort(key=lambda x: int(x[0].split("-")[-2]))
    drain = wait_for_dumps(run.dump_dir, [rid for rid, _ in cap], min(60, deadline - time.time()))
    run.result["drain_s"] = None if drain is None else round(drain, 3)
    run.result.update(evaluate(run, info, cap, responses))
    run.result["status"] = "done"
    log(f"{run.name}: checked; counts_ok={run.result['counts_ok']} layers_ok={run.result['layers_ok']}")


def evaluate(
    run: ArchRun, info: dict[str, Any], cap: list[tuple[str, list[int]]], responses: dict[str, Any]
) -> dict[str, Any]:
    assert run.refs is not None
    names = dump_tensor_names(info["hf_indices"], run.final_state)
    got: dict[str, list[Any]] = {n: [] for n in names}
    rows, exact = [], 0
    shape_ok = True
    for rid, ids in cap:
        row: dict[str, Any] = {"len": len(ids)}
        try:
            meta, t = load_dump(run.dump_dir, rid)
            row.update(rows=meta.num_tokens, cached=meta.cached_tokens, chunks=meta.extra.get("chunks"))
            row["non_finite"] = meta.non_finite
            ok = (
                meta.num_tokens == meta.prompt_tokens == len(ids)
                and meta.cached_tokens == 0
                and int(responses[rid]["meta_info"].get("cached_tokens", 0)) == 0
                and t["input_ids"].tolist() == ids
                and meta.extra.get("final_state") == run.final_state
            )
            names_ok = sorted(t) == sorted(["input_ids", *names])
            shape_ok &= names_ok and all(list(t[n].shape) == [len(ids), info["hidden_size"]] for n in names)
            row["exact"] = ok and names_ok
            exact += int(row["exact"])
            for n in names:
                got[n].append(t[n].to(GPU))
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:200]
            shape_ok = False
        rows.append(row)
    listing = sorted(os.listdir(run.dump_dir)) if os.path.isdir(run.dump_dir) else []
    stray = [d for d in listing if d not in {rid for rid, _ in cap}]
    layers: dict[str, Any] = {}
    if shape_ok:
        for n in names:
            bf16 = [r[n].to(GPU) for r in run.refs["bf16"]]
            fp32 = [r[n].to(GPU) for r in run.refs["fp32"]]
            fig = st.layer_figures(got[n], bf16, fp32)
            fig["neighbour"] = round(run.refs["neighbour"][n], 4)
            fig["ok"] = st.numerics_ok(fig)
            layers[n] = fig
    counts_ok = exact == len(cap) and not stray and shape_ok
    return {
        "prompts": rows,
        "counts": {"exact": exact, "prompts": len(cap)},
        "stray_dirs": stray,
        "health": responses.get("health"),
        "shape_ok": shape_ok,
        "counts_ok": counts_ok,
        "layers": layers,
        "layers_ok": bool(layers) and all(f["ok"] for f in layers.values()),
        "info_ok": info.get("final_state") == run.final_state and info.get("extra", {}).get("tp_size") == 1,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--deadline", type=float, required=True, help="epoch seconds: stop everything by then")
    p.add_argument("--archs", default=",".join(am.ARCHS))
    p.add_argument("--work", default="/tmp/hsx-matrix")
    p.add_argument("--base-port", type=int, default=BASE_PORT)
    p.add_argument("--dump-root", default="/dev/shm/hsx-matrix")
    p.add_argument("--dry-run-cpu", action="store_true", help="tiny models, reference engine, CPU")
    a = p.parse_args()
    if a.dry_run_cpu:
        global GPU
        GPU = "cpu"
        DRY_RUN["on"] = True
    # `timeout` sends SIGTERM: leave through the finally below, which stops the servers and writes the table
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = [n for n in a.archs.split(",") if n]
    runs = [ArchRun(i, n, a.work, a.out, a.dump_root) for i, n in enumerate(names)]
    for r in runs:
        r.port = a.base_port + r.index
    threads = [
        threading.Thread(
            target=serve_and_check, args=(r, runs[i - 1] if i else None, a.deadline), daemon=True
        )
        for i, r in enumerate(runs)
    ]
    for t in threads:
        t.start()
    log(f"matrix: {names}, {a.deadline - time.time():.0f}s left")
    try:
        import torch  # noqa: F401  (the main thread's GPU work: models, then reference states)

        for r in runs:
            try:
                cfg = am.make_model(r.name, r.model_dir, device=GPU, tiny=DRY_RUN["on"])
                r.prompts = prompts_for(r.name, cfg.vocab_size)
                r.result["status"] = "model ready"
            except Exception as exc:  # noqa: BLE001
                r.result["traceback"] = traceback.format_exc()[-2000:]
                r.fail(f"model: {exc!r}"[:300])
            r.model_ready.set()
        for r in runs:
            # Not the status: the server thread moves it on ("launched") as soon as the model is ready.
            if time.time() > a.deadline - 30 or not r.prompts:
                r.refs_ready.set()
                continue
            try:
                hf = contract.hf_indices(contract.eagle3_aux_layer_ids(am.NUM_LAYERS), am.NUM_LAYERS)
                r.refs = am.reference_states(r.model_dir, r.name, r.prompts, hf, GPU)
            except Exception as exc:  # noqa: BLE001
                r.result["ref_error"] = f"reference: {exc!r}"[:300]
                r.result["traceback"] = traceback.format_exc()[-2000:]
            r.refs_ready.set()
        log("matrix: models and references done")
        for t in threads:
            t.join(max(0.0, a.deadline - time.time()))
    finally:
        for r in runs:
            r.model_ready.set()
            r.refs_ready.set()
            if r.result["status"] in ("not started", "model ready"):
                r.result["status"] = "not run: time budget"
            elif r.result["status"] == "launched":
                r.result["status"] = "stopped at the deadline before its check finished"
            r.stop(fast=True)
        results = {r.name: dict(r.result) for r in runs}
        with open(os.path.join(a.out, "matrix.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)
        text = st.table(results)
        with open(os.path.join(a.out, "table.md"), "w") as fh:
            fh.write(text + "\n")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
