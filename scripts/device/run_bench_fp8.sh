#!/usr/bin/env bash
# Issue 18 on the lent H200, one shape per device call (run from the repository root):
#   carry: [".sglang-bundle", ".whl", ".device"]
#   command: HIDDEN=4096 bash scripts/device/run_bench_fp8.sh      (8B-shaped Llama: 32 layers, hidden 4096)
#            HIDDEN=7168 bash scripts/device/run_bench_fp8.sh      (the 8B Llama widened to 7168, 16 layers)
#            MODE=error bash scripts/device/run_bench_fp8.sh       (fp8 error table on the 8B-shaped model)
#            HIDDEN=7168 LAYERS=8 bash scripts/device/run_bench_fp8.sh  (an engine faster than the disk)
# With STREAM=1 (the default) the bench mode then runs `hsx bench stream` on the same engine:
#   $OUT/bench_stream.json (STREAM_SAMPLES, STREAM_TOKENS, STREAM_SAMPLES_PER_SHARD, STREAM_CONSUMERS,
#   STREAM_DB, STREAM_CAPS); FP8=0 skips the fp8 bench. Issue 26's stream rows (where the time goes, on SQLite
#   and PostgreSQL; carry ".device" with .device/postgres.tar.xz from scripts/device/pack_postgres.sh):
#     FP8=0 HIDDEN=7168 STREAM_CONSUMERS=8 STREAM_SAMPLES_PER_SHARD=4 STREAM_DB="sqlite postgres" \
#       STREAM_CAPS="0.1 1.0" bash scripts/device/run_bench_fp8.sh
# Needs what run_bench_e2e.sh needs (.sglang-bundle, .whl, .device/redis-server.xz; docs/sglang.md).
# MODE=bench (default): starts the patched SGLang engine (radix cache off, dummy weights: the speed does not
#   depend on their values) and runs `hsx bench fp8 --engine-url`: the same dataset as a bf16 job and as an
#   fp8 job, ABBA over ROUNDS, to the local disk; bytes written, job tok/s, ratios. $OUT/bench_fp8.json.
# MODE=error: writes a random-init 8B-shaped Llama (real bf16 weights, scripts/device/make_llama.py) and runs
#   bench/fp8_error.py on random-token prompts on the GPU: per-token cosine / relative L2 of fp8 states vs the
#   bf16 states, per tensor, per-tensor vs shared scales. $OUT/fp8_error.txt and $OUT/fp8_error.json.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=$(pwd)
OUT=${OUT:-/tmp/hsx-bench-out}
mkdir -p "$OUT/logs"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }
MODE=${MODE:-bench}
HIDDEN=${HIDDEN:-7168}
PROCESSES=${PROCESSES:-8}
CONCURRENCY=${CONCURRENCY:-8}
SAMPLES=${SAMPLES:-256}
ROUNDS=${ROUNDS:-1}
DEADLINE=${DEADLINE:-570}
export HSX_SGLANG_WRITER_THREADS=${WRITERS:-8}

source .sglang-bundle/install-on-device.sh .sglang-bundle > "$OUT/logs/install.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hsx-site .whl/*.whl >> "$OUT/logs/install.log" 2>&1
export PYTHONPATH="$R:/tmp/hsx-site:${PYTHONPATH:-}"
say "installed; $(nproc) cores"

if [ "$MODE" = error ]; then
  MODEL=/tmp/m8b-real
  [ -f $MODEL/config.json ] || python3 scripts/device/make_llama.py 8b $MODEL >> "$OUT/steps.log" 2>&1
  say "model ready"
  timeout $(( DEADLINE - ($(date +%s) - T0) - 10 )) python3 bench/fp8_error.py --model $MODEL --random-tokens \
    --prompts ${PROMPTS:-32} --length ${LENGTH:-1024} 2> "$OUT/logs/fp8_error.log" | tee "$OUT/fp8_error.txt"
  say "fp8_error exit ${PIPESTATUS[0]}"
  tail -n 1 "$OUT/fp8_error.txt" > "$OUT/fp8_error.json"
  tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
  exit 0
fi

mkdir -p /tmp/hsx-bin && xz -dc .device/redis-server.xz > /tmp/hsx-bin/redis-server && chmod +x /tmp/hsx-bin/redis-server
export PATH="/tmp/hsx-bin:$PATH"
# LAYERS overrides the shape's depth: fewer layers make the engine faster than the disk, which is the case
# fp8 is for (LAYERS=8 at HIDDEN=7168: prefill well above the disk's fsynced rate of bf16 states).
LAYERS=${LAYERS:-}
MODEL=/tmp/llama-h$HIDDEN-l${LAYERS:-default}
if [ ! -f $MODEL/config.json ]; then
  python3 - "$MODEL" "$HIDDEN" "$LAYERS" <<'PY'
import sys
from transformers import LlamaConfig
hidden = int(sys.argv[2])
shape = {4096: dict(intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
         7168: dict(intermediate_size=18432, num_hidden_layers=16, num_attention_heads=56)}[hidden]
if sys.argv[3]:
    shape["num_hidden_layers"] = int(sys.argv[3])
LlamaConfig(vocab_size=128256, hidden_size=hidden, num_key_value_heads=8, max_position_embeddings=8192,
            rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
            architectures=["LlamaForCausalLM"], **shape).save_pretrained(sys.argv[1])
PY
fi
say "model config ready (hidden $HIDDEN, layers ${LAYERS:-of the shape})"
# The disk's own fsynced write rate where the shards go, to say which of engine and disk is the limit.
dd if=/dev/zero of=/tmp/hsx-ddtest bs=64M count=48 conv=fsync 2>&1 | tail -n 1 | tee -a "$OUT/steps.log"
rm -f /tmp/hsx-ddtest
setsid python3 -m workers.engines.sglang.launcher --model-path $MODEL --port 30000 --dump-dir /dev/shm/hsx-dumps \
  --attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-cuda-graph \
  --disable-radix-cache --skip-tokenizer-init --load-format dummy --writer-threads "$HSX_SGLANG_WRITER_THREADS" \
  > "$OUT/logs/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 300); do
  kill -0 $SERVER 2> /dev/null || break
  curl -sf localhost:30000/health > /dev/null 2>&1 && curl -sf localhost:30000/hsx/info > /dev/null && break
  sleep 1
done
curl -sf localhost:30000/hsx/info > "$OUT/logs/info.json" || { say "engine failed"; tail -40 "$OUT/logs/server.log"; exit 1; }
say "engine up"
(vmstat -t 1 > "$OUT/logs/vmstat.txt" 2>&1 &)
if [ "${FP8:-1}" = 1 ]; then
LEFT=$(( DEADLINE - ($(date +%s) - T0) ))
timeout $(( LEFT - 15 )) python3 -m hsx.cli bench fp8 --engine-url http://127.0.0.1:30000 --vocab 128256 \
  --samples "$SAMPLES" --tokens 1024 --processes "$PROCESSES" --concurrency "$CONCURRENCY" \
  --samples-per-shard $(( SAMPLES / PROCESSES < 32 ? SAMPLES / PROCESSES : 32 )) --rounds "$ROUNDS" \
  2> "$OUT/logs/bench_fp8.h$HIDDEN.log" | tee "$OUT/logs/bench_fp8.h$HIDDEN.txt"
say "bench exit ${PIPESTATUS[0]}"
tail -n 1 "$OUT/logs/bench_fp8.h$HIDDEN.txt" >> "$OUT/bench_fp8.json"
fi
# Issue 17 on the same engine: `hsx bench stream` (a consume job under a cap of a tenth of its output, drained
# by a consumer, vs the same job kept). Many small units, so that the cap holds ten or more of them.
# STREAM_DB=sqlite|postgres|"sqlite postgres" picks the job table(s) (postgres needs .device/postgres.tar.xz,
# made by scripts/device/pack_postgres.sh: about 4 MB more to carry); STREAM_CAPS the cap fractions ("0.1 1.0").
if [ "${STREAM:-1}" = 1 ]; then
  case "${STREAM_DB:-sqlite}" in *postgres*) source scripts/device/postgres_on_device.sh /tmp/hsx-site ;; esac
  for DB in ${STREAM_DB:-sqlite}; do
    for CAPF in ${STREAM_CAPS:-0.1}; do
      LEFT=$(( DEADLINE - ($(date +%s) - T0) ))
      [ "$LEFT" -lt 90 ] && { say "skipped stream $DB cap $CAPF: ${LEFT}s left"; continue; }
      TAG="h$HIDDEN.$DB.cap$CAPF"
      timeout $(( LEFT - 15 )) python3 -m hsx.cli bench stream --engine-url http://127.0.0.1:30000 --vocab 128256 \
        --samples "${STREAM_SAMPLES:-1024}" --tokens "${STREAM_TOKENS:-512}" --samples-per-shard "${STREAM_SAMPLES_PER_SHARD:-8}" \
        --consumers "${STREAM_CONSUMERS:-4}" --processes "$PROCESSES" --concurrency "$CONCURRENCY" \
        --db "$DB" --cap-fraction "$CAPF" \
        2> "$OUT/logs/bench_stream.$TAG.log" | tee "$OUT/logs/bench_stream.$TAG.txt"
      say "stream bench ($DB, cap $CAPF) exit ${PIPESTATUS[0]}"
      tail -n 1 "$OUT/logs/bench_stream.$TAG.txt" | sed "s/^{/{\"cap_fraction\": $CAPF, /" >> "$OUT/bench_stream.json"
    done
  done
fi
kill -TERM -- -"$SERVER" 2> /dev/null
pkill -x vmstat 2> /dev/null
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
