"""Where a drafter-proof training step goes, measured before the real trainings start: SpecForge 0.2.0's own
trainer on synthetic features of the proof's shapes (SmolLM2-135M: hidden 576, three aux layers, samples of
120-600 tokens, about the 356 the real set averages; draft vocabulary 32,000 of 49,152), in four layouts:

- ``as_before``: one trainer, as the 2026-12-07 run trained (no prefetch, SpecForge's per-step
  ``torch.cuda.empty_cache()``), with SpecForge's profiler over three steps;
- ``fast``: one trainer with train_entry.py's FAST=1 (prefetch threads, no per-step empty_cache);
- ``fast_x4``: four such trainers at once, as the real run trains its rows;
- ``fast_x4_mps``: the same under CUDA MPS, where the image has it (kernels of the four processes then
  share the card instead of taking turns).

Each run logs SpecForge's own per-window figures (``perf/optimizer_step_time_s``, ``perf/data_wait_time_s``,
``perf/train_compute_time_s``); the mean after the first window is reported. The profile's busiest CUDA
kernels and CPU ops are summarised. Writes OUT_DIR/probe.json and, when MPS is faster, WORK/mps_on (the real
trainings then start under it).

    python3 probe.py WORK OUT_DIR DRAFT_JSON TRAIN_ENTRY
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

STEPS = 60
PROFILE_AT = 30


def make_target(root: Path) -> Path:
    import torch
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    target = root / "target"
    if (target / "model.safetensors.index.json").is_file():
        return target
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(target))
    keys = list(safe_open(str(target / "model.safetensors"), "pt").keys())
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


def make_features(root: Path, count: int = 512) -> tuple[Path, Path]:
    import torch

    feats, mapping = root / "feat", root / "vocab_mapping.pt"
    if mapping.is_file():
        return feats, mapping
    g = torch.Generator().manual_seed(1)
    for i in range(count):
        t = int(torch.randint(120, 601, (1,), generator=g))
        mask = torch.ones(t, dtype=torch.long)
        mask[:40] = 0
        sample = {
            "input_ids": torch.randint(0, 49152, (t,), generator=g),
            "loss_mask": mask,
            "hidden_state": torch.randn(1, t, 576, generator=g).to(torch.bfloat16),
            "aux_hidden_state": torch.randn(1, t, 3 * 576, generator=g).to(torch.bfloat16),
        }
        folder = feats / f"rows_{i // 2000 * 2000}-{i // 2000 * 2000 + 2000}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(sample, folder / f"data_{i}.ckpt")
    used = list(range(32000))
    d2t = torch.tensor([used[i] - i for i in range(32000)])
    t2d = torch.tensor([i < 32000 for i in range(49152)])
    torch.save({"d2t": d2t, "t2d": t2d}, mapping)
    return feats, mapping


def config(name: str, work: Path, target: Path, feats: Path, mapping: Path, draft: str, port: int,
           fast: bool, profile: bool) -> Path:
    run = work / name
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    profiling = f"profiling:\n  enabled: true\n  start_step: {PROFILE_AT}\n  num_steps: 3\n" if profile else ""
    (run / "run.yaml").write_text(f"""model:
  target_model_path: {target}
  draft_model_config: {draft}
  lm_head_key: model.embed_tokens.weight
  embedding_key: model.embed_tokens.weight
  vocab_mapping_path: {mapping}
  torch_dtype: bfloat16
data:
  hidden_states_path: {feats}
  max_length: 1024
  chat_template: llama3
  cache_dir: {run}/cache
  dataloader_num_workers: {4 if fast else 0}
training:
  strategy: eagle3
  num_epochs: 1
  max_steps: {STEPS}
  batch_size: 4
  learning_rate: 0.0003
  ttt_length: 7
  attention_backend: sdpa
  seed: 42
  log_interval: 10
{profiling}run_id: {name}
output_dir: {run}/out
deployment:
  mode: local_colocated
  trainer:
    master_port: {port}
""")
    return run


def perf(log: Path) -> dict[str, Any]:
    windows: dict[str, list[float]] = defaultdict(list)
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("step ") or ": {" not in line:
            continue
        try:
            metrics = ast.literal_eval(line.split(": ", 1)[1])
        except (ValueError, SyntaxError):
            continue
        for key in ("perf/optimizer_step_time_s", "perf/data_wait_time_s", "perf/train_compute_time_s"):
            if key in metrics:
                windows[key.split("/")[1]].append(float(metrics[key]))
    # The first window holds the warm-up (Triton compiles, allocator growth).
    return {k: round(statistics.mean(v[1:] or v), 4) for k, v in windows.items()}


def run_layout(name: str, count: int, work: Path, out: Path, args: dict[str, Any], env: dict[str, str],
               fast: bool, profile: bool, entry: str) -> dict[str, Any]:
    procs = []
    started = time.time()
    for i in range(count):
        tag = f"{name}_{i}" if count > 1 else name
        run = config(tag, work, port=29600 + len(procs) + 10 * count, fast=fast, profile=profile and i == 0,
                     **args)
        log = out / f"probe_{tag}.log"
        cmd = [sys.executable, entry, "train", "-c", "run.yaml"]
        procs.append((tag, run, log, subprocess.Popen(
            cmd, cwd=run, stdout=log.open("w"), stderr=subprocess.STDOUT,
            env={**env, "FAST": "1" if fast else "0"})))
    result: dict[str, Any] = {"trainers": count, "fast": fast}
    for tag, run, log, proc in procs:
        result[tag] = {"exit": proc.wait(timeout=600), **perf(log)}
        traces = sorted((run / "out").rglob("*.trace.json.gz"))
        if traces:
            result[tag]["profile"] = summarise(traces[0])
    result["wall_s"] = round(time.time() - started, 1)
    return result


def summarise(trace: Path, top: int = 12) -> dict[str, Any]:
    events = json.load(gzip.open(trace)).get("traceEvents", [])
    kernels: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    first, last, busy = float("inf"), 0.0, 0.0
    for e in events:
        if e.get("ph") != "X":
            continue
        dur = float(e.get("dur", 0))
        if e.get("cat") == "kernel":
            kernels[e["name"][:80]] += dur
            busy += dur
        elif e.get("cat") == "cpu_op":
            ops[e["name"][:80]] += dur
        first, last = min(first, float(e["ts"])), max(last, float(e["ts"]) + dur)
    span = max(last - first, 1.0)
    return {
        "span_ms": round(span / 1000, 1),
        "gpu_kernel_busy_fraction": round(busy / span, 3),
        "top_kernels_ms": {k: round(v / 1000, 2) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]},
        "top_cpu_ops_ms": {k: round(v / 1000, 2) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:top]},
    }


def start_mps(work: Path) -> dict[str, str] | None:
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return None
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(work / "mps" / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(work / "mps" / "log")}
    for d in env.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    if subprocess.run([control, "-d"], env={**os.environ, **env}).returncode != 0:
        return None
    # A client under MPS must work, and so must one outside it: the engines run beside the server.
    ok = all(_cuda_works({**os.environ, **e}) for e in (env, {}))
    if not ok:
        stop_mps(env)
    return env if ok else None


def _cuda_works(env: dict[str, str]) -> bool:
    code = "import torch; x = torch.ones(4, device='cuda'); print(float(x.sum()))"
    check = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return check.returncode == 0 and check.stdout.strip() == "4.0"


def stop_mps(env: dict[str, str]) -> None:
    control = shutil.which("nvidia-cuda-mps-control") or "nvidia-cuda-mps-control"
    subprocess.run([control], input="quit\n", text=True, env={**os.environ, **env}, timeout=60)


def main(argv: list[str]) -> int:
    work, out, draft, entry = Path(argv[1]) / "probe", Path(argv[2]), argv[3], argv[4]
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"steps": STEPS}
    started = time.time()
    target = make_target(work)
    feats, mapping = make_features(work)
    report["setup_s"] = round(time.time() - started, 1)
    args = {"target": target, "feats": feats, "mapping": mapping, "draft": draft}
    env = dict(os.environ)
    layouts = [("as_before", 1, False, True), ("fast", 1, True, False), ("fast_x4", 4, True, False)]
    for name, count, fast, profile in layouts:
        report[name] = run_layout(name, count, work, out, args, env, fast, profile, entry)
        (out / "probe.json").write_text(json.dumps(report, indent=1))
    mps = start_mps(work)
    report["mps_available"] = mps is not None
    if mps is not None:
        report["fast_x4_mps"] = run_layout("fast_x4_mps", 4, work, out, args, {**env, **mps}, True, False, entry)

        def mean_step(layout: dict[str, Any]) -> float:
            times = [v.get("optimizer_step_time_s", 1e9) for v in layout.values() if isinstance(v, dict)]
            return statistics.mean(times) if times else 1e9

        if mean_step(report["fast_x4_mps"]) < 0.9 * mean_step(report["fast_x4"]):
            (work.parent / "mps_on").write_text("1")
        else:
            stop_mps(mps)
    report["mps_chosen"] = (work.parent / "mps_on").is_file()
    report["total_s"] = round(time.time() - started, 1)
    (out / "probe.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
