#!/usr/bin/env bash
# The drafter proof's "hsx, streamed" row (docs/drafter.md; docs/streaming.md, "SpecForge's own stream"):
# SpecForge 0.2.0's own trainer (`specforge train`, deployment.mode disaggregated, role consumer) trains
# from a running hsx `consume` job through `hsx feed specforge`, under a byte cap smaller than the job's
# output, with the offline rows' recipe and samples (each conversation once per epoch).
#
#   bash scripts/device/drafter/streamed.sh start    # starts everything in the background, returns
#   bash scripts/device/drafter/streamed.sh status   # one JSON line
#   bash scripts/device/drafter/streamed.sh stop     # stops everything start started, by pid
#   bash scripts/device/drafter/streamed.sh config   # only writes the trainer's YAML ($W/streamed/run.yaml)
#
# Inputs (environment): W (work dir), MODEL (target model dir), TRAIN_JSONL ({"id", "messages"} lines),
# VOCAB_MAPPING (the hsx export's vocab_mapping.pt), ENGINE_URL (a running hsx engine), DRAFT_CONFIG,
# EPOCHS, LR, BATCH, MAXLEN, SEED, CAP_FRACTION (the job's byte cap over its projected output), OUT (logs),
# PORT_BASE (six ports from it: Redis, API, Mooncake rpc, metadata, metrics, trainer). Optional: PY
# (python3), SPECFORGE (the trainer's command, default "$PY -m specforge.cli"), SHARD (samples per
# shard, 32), WINDOW (the feeder's refs in flight, 64), CONCURRENCY (the worker's requests, 32),
# LOG_INTERVAL (the trainer's, 20 as in train_one), LOADER_WORKERS (the trainer's dataloader_num_workers,
# 0; the drafter proof passes its offline rows' 4). The engine must serve the target in bfloat16: SpecForge
# 0.2.0's online consumer hands the states unconverted to its bfloat16 target head and draft (the feeder
# refuses another dtype).
#
# SpecForge 0.2.0's online consumer reads features from Mooncake only (its config refuses shared_dir for
# online runs), so this starts a mooncake_master, and the feeder puts each sample's tensors into it; the
# features the trainer has not consumed yet live in the feeder's Mooncake segment (memory), and the
# job's shards on disk stay under the cap. State: $W/streamed (pids, job id, peaks, the SQLite job table);
# logs: $OUT/streamed_*.log and $OUT/train_streamed.log; the draft: $W/train/streamed/out; the trainer's
# exit status: $W/train/streamed/exit.
set -u
R=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
D=$R/scripts/device/drafter
PY=${PY:-python3}
SPECFORGE=${SPECFORGE:-"$PY -m specforge.cli"}
SHARD=${SHARD:-32}; WINDOW=${WINDOW:-64}; CONCURRENCY=${CONCURRENCY:-32}; LOG_INTERVAL=${LOG_INTERVAL:-20}
export PYTHONPATH="$R${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# This script owns its processes' stream settings: none may come from the caller's environment (SpecForge's
# launcher lets MOONCAKE_* and some DISAGG_* in the environment win over the YAML).
for v in $(env | grep -oE '^(DISAGG|MOONCAKE)_[A-Z_]+'); do unset "$v"; done
# Mooncake (mooncake.store and mooncake_master) comes from the caller's PYTHONPATH and LD_LIBRARY_PATH: the
# drafter proof carries the parts of its wheel these load, with the libraries they link (fetch_inputs.sh).

need() {  # need VAR...: each named variable is set, or the script stops saying which is not
  local v
  for v in "$@"; do [ -n "${!v:-}" ] || { echo "streamed.sh: $v is not set" >&2; exit 2; }; done
}
need W
S=$W/streamed; TD=$W/train/streamed

ports() {
  need PORT_BASE
  P_REDIS=$PORT_BASE; P_API=$((PORT_BASE + 1)); P_MC_RPC=$((PORT_BASE + 2)); P_MC_META=$((PORT_BASE + 3))
  P_MC_METRICS=$((PORT_BASE + 4)); P_TRAINER=$((PORT_BASE + 5))
}

# The train_one recipe of drafter_proof.sh, as SpecForge's online consumer: the same model, data and
# training fields, plus the disaggregated deployment. data.train_data_path is the conversations the job's
# dataset repeats: an online run names a raw source, which only a producer reads (hsx's feeder is ours).
# The feeder reads this same file (--specforge-config) for the schedule record and the stream's endpoints.
write_config() {
  need MODEL TRAIN_JSONL VOCAB_MAPPING DRAFT_CONFIG EPOCHS LR BATCH MAXLEN SEED
  ports
  mkdir -p "$S"
  cat > "$S/run.yaml" <<YAML
model:
  target_model_path: $MODEL
  draft_model_config: $DRAFT_CONFIG
  lm_head_key: model.embed_tokens.weight
  embedding_key: model.embed_tokens.weight
  vocab_mapping_path: $VOCAB_MAPPING
  torch_dtype: bfloat16
data:
  train_data_path: $TRAIN_JSONL
  max_length: $MAXLEN
  chat_template: llama3
  cache_dir: $TD/cache
  dataloader_num_workers: ${LOADER_WORKERS:-0}
training:
  strategy: eagle3
  role: consumer
  num_epochs: $EPOCHS
  batch_size: $BATCH
  learning_rate: $LR
  ttt_length: 7
  attention_backend: sdpa
  seed: $SEED
  log_interval: $LOG_INTERVAL
run_id: streamed
output_dir: $TD/out
deployment:
  mode: disaggregated
  trainer:
    master_port: $P_TRAINER
  disaggregated:
    control_dir: $S/control
    backend: mooncake
    store_id: hsx-streamed
    mooncake_master_server_addr: 127.0.0.1:$P_MC_RPC
    mooncake_metadata_server: http://127.0.0.1:$P_MC_META/metadata
    mooncake_local_hostname: 127.0.0.1
    mooncake_protocol: tcp
    peer_wait_timeout_s: 1800
    idle_timeout_s: 900
YAML
}

bg() {  # bg NAME LOG CMD... -- in a session of its own, so it outlives this call; its pid in $S/NAME.pid
  local name=$1 log=$2; shift 2
  setsid "$@" > "$log" 2>&1 < /dev/null &
  echo $! > "$S/$name.pid"
}

wait_for() {  # wait_for WHAT SECONDS NAME CHECK... -- CHECK until it passes, while NAME's process lives
  local what=$1 seconds=$2 name=$3; shift 3
  for _ in $(seq 1 $((seconds * 4))); do
    "$@" > /dev/null 2>&1 && return 0
    kill -0 "$(cat "$S/$name.pid")" 2>/dev/null || { echo "streamed.sh: $what exited" >&2; return 1; }
    sleep 0.25
  done
  echo "streamed.sh: $what did not come up in ${seconds}s" >&2; return 1
}

port_open() { $PY -c "import socket,sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1)" "$1"; }

started_pids() { for p in "$S"/*.pid; do [ -f "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null && echo "$p"; done; }

start() {
  need MODEL TRAIN_JSONL VOCAB_MAPPING ENGINE_URL DRAFT_CONFIG EPOCHS LR BATCH MAXLEN SEED CAP_FRACTION OUT PORT_BASE
  [ -z "$(started_pids 2>/dev/null)" ] || { echo "streamed.sh: already started ($S); stop it first" >&2; exit 2; }
  local mc
  mc=$($PY -c "import mooncake.store, mooncake, os; print(os.path.dirname(mooncake.__file__))" 2>&1) || {
    echo "streamed.sh: Mooncake is not importable ($(echo "$mc" | tail -1)): SpecForge 0.2.0's online consumer reads" \
      "features only from Mooncake; install mooncake-transfer-engine-non-cuda (it loads libibverbs.so.1," \
      "libnl-3 and libnl-route-3 even over TCP)" >&2
    exit 2
  }
  $PY -c "import specforge.cli" || { echo "streamed.sh: specforge is not importable" >&2; exit 2; }
  command -v redis-server > /dev/null || { echo "streamed.sh: no redis-server on PATH" >&2; exit 2; }
  rm -rf "$S" "$TD"; mkdir -p "$S/hsx" "$TD" "$OUT"
  write_config
  cp "$S/run.yaml" "$OUT/streamed_run.yaml"
  echo "$TD" > "$S/train_dir"; echo "$OUT/train_streamed.log" > "$S/train_log"
  export HSX_DATA_DIR=$S/hsx HSX_DATABASE_URL=sqlite:///$S/hsx/hsx.sqlite3 HSX_REDIS_URL=redis://127.0.0.1:$P_REDIS/0
  export HSX_QUEUE_NAME=hsx-streamed HSX_DATASET_ROOTS=$S HSX_API_URL=http://127.0.0.1:$P_API
  export HSX_ENGINE_URL=$ENGINE_URL HSX_ENGINE_CONCURRENCY=$CONCURRENCY
  unset HSX_API_TOKEN HSX_API_TOKEN_FILE
  echo "$HSX_API_URL" > "$S/api_url"

  bg redis "$OUT/streamed_redis.log" redis-server --port "$P_REDIS" --bind 127.0.0.1 --save "" --appendonly no
  wait_for redis 20 redis $PY -c "import sys; from hsx.cli.local_stack import redis_reachable as r; sys.exit(not r('$HSX_REDIS_URL'))" || exit 1
  $PY -m hsx.cli db upgrade > "$OUT/streamed_db.log" 2>&1 || { echo "streamed.sh: db upgrade failed" >&2; exit 1; }
  bg api "$OUT/streamed_api.log" $PY -m hsx.cli api --port "$P_API"
  bg worker "$OUT/streamed_worker.log" $PY -m hsx.cli worker
  bg mooncake "$OUT/streamed_mooncake.log" "$mc/mooncake_master" --rpc_port="$P_MC_RPC" \
    --enable_http_metadata_server=true --http_metadata_server_host=127.0.0.1 \
    --http_metadata_server_port="$P_MC_META" --metrics_host=127.0.0.1 --metrics_port="$P_MC_METRICS"
  wait_for api 60 api curl -sf "$HSX_API_URL/healthz" || exit 1
  wait_for mooncake_master 30 mooncake port_open "$P_MC_META" || exit 1

  # The job's dataset: every conversation once per epoch, each epoch in SpecForge's own order (seed + epoch).
  local plan prompts expected cap job
  plan=$($PY -m hsx.integrations.specforge.schedule epochs "$TRAIN_JSONL" "$S/train_epochs.jsonl" \
    --specforge-config "$S/run.yaml") || exit 1
  prompts=$($PY -c "import json,sys; print(json.loads(sys.argv[1])['prompts'])" "$plan")
  expected=$($PY "$D/streamed.py" expect "$S/train_epochs.jsonl" "$ENGINE_URL" "$MAXLEN" "$SHARD") || exit 1
  cap=$($PY -c "import sys; print(max(1, int(float(sys.argv[1]) * int(sys.argv[2]))))" "$CAP_FRACTION" "$expected")
  $PY -m hsx.cli submit "$S/train_epochs.jsonl" --api-url "$HSX_API_URL" --json --retention consume \
    --buffer-cap-bytes "$cap" --max-length "$MAXLEN" --samples-per-shard "$SHARD" > "$S/job.json" \
    2> "$OUT/streamed_submit.log" || { echo "streamed.sh: submit failed: $(tail -3 "$OUT/streamed_submit.log")" >&2; exit 1; }
  job=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['id'])" "$S/job.json") || exit 1
  echo "$job" > "$S/job_id"

  # The feeder takes channel, store and Mooncake endpoints from the trainer's YAML, writes the schedule
  # record the trainer waits for, and fails the channel (the trainer then raises) on any mismatch.
  bg feeder "$OUT/streamed_feeder.log" bash -c '"${@:2}"; echo $? > "$1/feeder.exit"' _ "$S" \
    $PY -m hsx.cli feed specforge "$job" --specforge-config "$S/run.yaml" --prompts "$prompts" \
    --window "$WINDOW" --api-url "$HSX_API_URL"
  bg trainer "$OUT/train_streamed.log" bash -c 'cd "$1" && "${@:2}"; echo $? > "$1/exit"' _ "$TD" \
    $SPECFORGE train -c "$S/run.yaml" --role consumer
  bg monitor "$OUT/streamed_monitor.log" $PY "$D/streamed.py" monitor "$S"
  echo "{\"job\": \"$job\", \"prompts\": $prompts, \"epochs\": $EPOCHS, \"expected_bytes\": $expected, \"cap_bytes\": $cap}" | tee "$S/started.json"
}

stop() {
  local p pids=()
  # The trainer first (it marks its consumer failed, so the feeder hands its shards back), the servers last.
  for name in trainer monitor feeder worker api mooncake redis; do
    p=$S/$name.pid
    [ -f "$p" ] || continue
    kill -TERM -- -"$(cat "$p")" 2>/dev/null && pids+=("$(cat "$p")")
  done
  for _ in $(seq 1 120); do
    local left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ $left = 0 ] && break
    sleep 0.25
  done
  for pid in "${pids[@]}"; do kill -KILL -- -"$pid" 2>/dev/null; done
  rm -f "$S"/*.pid
  echo "{\"stopped\": ${#pids[@]}}"
}

case "${1:-}" in
  start) start ;;
  status) $PY "$D/streamed.py" status "$S" ;;
  stop) stop ;;
  config) write_config; echo "$S/run.yaml" ;;
  *) echo "usage: streamed.sh start|status|stop|config (see its header)" >&2; exit 2 ;;
esac
