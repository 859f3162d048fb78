# The drafter proof's shell functions, sourced by scripts/device/drafter_proof.sh (which sets R, W, OUT, D,
# MODEL and the recipe). Everything a call starts in the background runs in a session of its own (setsid),
# so it outlives the call while the machine stays warm; its state lives under $W, its logs under $W/out,
# which every call packs into one tarball.

T0=$(cat "$W/t0" 2>/dev/null || { date +%s | tee "$W/t0"; })
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$W/out/steps.log"; }

env_on() {  # the SGLang 0.5.17 site and the carried wheels
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

wait_file() {  # wait_file PATH SECONDS
  for _ in $(seq 1 "$2"); do [ -e "$1" ] && return 0; sleep 1; done
  return 1
}

# SGLang sizes its KV pool from the memory free when it starts, less (1 - fraction) of the card, so with
# other processes on the card a low fraction can leave nothing: every server here asks for 0.9 and caps its
# pool in tokens instead, which keeps its share small whatever started before it.
engine() {  # engine NAME PORT MAX_TOKENS -- the patched engine, radix cache off
  setsid python3 -m workers.engines.sglang.launcher --model-path "$MODEL" --port "$2" --dump-dir "/dev/shm/dp-$1" \
    --dtype bfloat16 --attention-backend triton --sampling-backend pytorch --grammar-backend none \
    --disable-cuda-graph --mem-fraction-static 0.9 --max-total-tokens "$3" --disable-radix-cache \
    > "$W/out/engine_$1.log" 2>&1 &
  echo $! > "$W/engine_$1.pid"
  wait_http "$2" 400 "$!" || { say "engine $1 failed: $(tail -5 "$W/out/engine_$1.log" | tr '\n' ' ')"; return 1; }
  say "engine $1 up on $2"
}

stop_pidfile() {  # stop_pidfile FILE -- the process group a setsid launch started
  [ -f "$1" ] && kill -TERM -- -"$(cat "$1")" 2>/dev/null
  rm -f "$1"
}

gpu_mem() { nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | tr -d '\n'; }

# The recipe as SpecForge 0.2.0's `specforge train` reads it (docs/drafter.md). Only these knobs differ
# between the rows: the features, the seed and the port; FAST=1 applies what does not change the math:
# data prefetch threads (SpecForge keeps the batch order) and no per-step torch.cuda.empty_cache().
train_yaml() {  # train_yaml NAME FEATURES PORT SEED STEPS_OR_EMPTY LR PROFILE(0|1)
  local dir=$W/train/$1 steps_line="" profile=""
  [ -n "$5" ] && steps_line="  max_steps: $5"
  [ "$7" = 1 ] && profile=$'profiling:\n  enabled: true\n  start_step: 100\n  num_steps: 3'
  cat <<YAML
model:
  target_model_path: $MODEL
  draft_model_config: $D/draft.json
  lm_head_key: model.embed_tokens.weight
  embedding_key: model.embed_tokens.weight
  vocab_mapping_path: ${VOCAB_MAPPING:-$W/feat/hsx/vocab_mapping/vocab_mapping.pt}
  torch_dtype: bfloat16
data:
  hidden_states_path: $2
  max_length: $MAXLEN
  chat_template: llama3
  cache_dir: $dir/cache
  dataloader_num_workers: $([ "${FAST:-1}" = 1 ] && echo 4 || echo 0)
training:
  strategy: eagle3
  num_epochs: $EPOCHS
$steps_line
  batch_size: $BATCH
  learning_rate: $6
  ttt_length: 7
  attention_backend: sdpa
  seed: $4
  log_interval: 20
$profile
run_id: $1
output_dir: $dir/out
deployment:
  mode: local_colocated
  trainer:
    master_port: $3
YAML
}

train_start() {  # train_start NAME FEATURES PORT SEED [STEPS] [LR] [PROFILE] -- in the background, `exit` when done
  local dir=$W/train/$1
  rm -rf "$dir"; mkdir -p "$dir"
  train_yaml "$1" "$2" "$3" "$4" "${5:-}" "${6:-$LR}" "${7:-0}" > "$dir/run.yaml"
  local mps=""; [ -f "$W/mps_on" ] && mps="CUDA_MPS_PIPE_DIRECTORY=$W/mps/pipe CUDA_MPS_LOG_DIRECTORY=$W/mps/log"
  setsid bash -c "cd '$dir' && env $mps FAST=${FAST:-1} python3 $D/train_entry.py train -c run.yaml > '$W/out/train_$1.log' 2>&1; \
    echo \$? > '$dir/exit'" > /dev/null 2>&1 &
  echo $! > "$dir/pid"
  say "training $1 started (features $2, seed $4, epochs $EPOCHS, lr ${6:-$LR}, batch $BATCH, fast ${FAST:-1}${mps:+, mps})"
}

train_wait() {  # train_wait SECONDS NAME... -- true once every named run has an exit file
  local deadline=$(( $(date +%s) + $1 )); shift
  while :; do
    local left=0
    for n in "$@"; do [ -f "$W/train/$n/exit" ] || left=$((left + 1)); done
    [ "$left" = 0 ] && return 0
    [ "$(date +%s)" -ge "$deadline" ] && return 1
    sleep 5
  done
}

train_progress() {  # the last logged step of each run
  for n in "$@"; do
    printf '%s: exit %s, %s\n' "$n" "$(cat "$W/train/$n/exit" 2>/dev/null || echo -)" \
      "$(grep -o '^step [0-9]*' "$W/out/train_$n.log" 2>/dev/null | tail -1)"
  done | tr '\n' ';'
}

export_draft() {  # export_draft NAME -- the last checkpoint, in SGLang's layout
  local ck; ck=$(ls -d "$W/train/$1"/out/*step* 2>/dev/null | sort -V | tail -1)
  rm -rf "$W/draft/$1"
  python3 -c 'import sys; from specforge.cli import main; sys.exit(main(sys.argv[1:]))' export --to sglang \
    --checkpoint "$ck" --draft-config "$D/draft.json" --output-dir "$W/draft/$1" > "$W/out/export_$1.log" 2>&1
  local rc=$?
  say "export $1 ($(basename "$ck")) exit $rc"
  return $rc
}

serve_start() {  # serve_start NAME PORT STEPS TOPK TOKENS -- an EAGLE-3 server for one draft
  setsid python3 -m sglang.launch_server --model-path "$MODEL" --dtype bfloat16 --port "$2" --skip-tokenizer-init \
    --attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-cuda-graph \
    --mem-fraction-static 0.9 --max-total-tokens 65536 --speculative-algorithm EAGLE3 \
    --speculative-draft-model-path "$W/draft/$1" --speculative-num-steps "$3" --speculative-eagle-topk "$4" \
    --speculative-num-draft-tokens "$5" > "$W/out/serve_$1_$3$4$5.log" 2>&1 &
  echo "$! $2" > "$W/serve_$1.pid"
}

tau_one() {  # tau_one NAME STEPS TOPK TOKENS -- waits for the server, measures, stops it
  local pid port; read -r pid port < "$W/serve_$1.pid"
  local chain=$2$3$4
  if wait_http "$port" 400 "$pid"; then
    python3 "$D/tau.py" "http://127.0.0.1:$port" "$MODEL" "$W/prompts/heldout_prompts.jsonl" 256 24 \
      > "$W/out/tau_$1_$chain.json" 2>> "$W/out/tau_$1.log"
    say "tau $1 chain $2/$3/$4: $(cat "$W/out/tau_$1_$chain.json")"
  else
    say "server $1 failed: $(tail -5 "$W/out/serve_$1_$chain.log" | tr '\n' ' ')"
  fi
  grep -o "accept len: [0-9.]*" "$W/out/serve_$1_$chain.log" | awk -v n="$1" -v c="$chain" \
    '{s+=$3; k++} END {if (k) printf "server log %s %s: mean accept len %.3f over %d logged batches\n", n, c, s/k, k}' \
    >> "$W/out/steps.log"
  kill -TERM -- -"$pid" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
}

pack() {  # pack NAME -- everything under $W/out so far, as one file under $OUT (at most 8 come back)
  cp "$W/out/steps.log" "$OUT/steps.log" 2>/dev/null
  tar -czf "$OUT/$1.tgz" -C "$W" out 2>/dev/null
  ls -la "$OUT"
  tail -40 "$W/out/steps.log"
}
