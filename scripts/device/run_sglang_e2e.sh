#!/usr/bin/env bash
# The SGLang engine end to end, in ONE device call (run from the repository root, carry .sglang-bundle):
#   bash scripts/device/run_sglang_e2e.sh
# 1. installs the SGLang 0.5.17 bundle; makes a random-init 8B-shaped Llama; computes the Hugging Face
#    reference states for prompts of 1 .. 8,192 tokens;
# 2. server A (patched, --disable-radix-cache, --chunked-prefill-size 2048): HF comparison in concurrent
#    mixed batches, stray-dump check, shared-prefix pair verifies, staggered aborts, capture cost;
# 3. server B (patched, radix cache on, default chunk size): the shared-prefix pair fails verification on
#    cached_tokens, passes with distinct extra_keys; capture cost with a distinct extra_key per request;
# The HF reference is computed in bf16 and, from the same weights, in fp32: the fp32 states are the exact
# ones, so the table shows how far SGLang's and HF's own bf16 forwards each are from them.
# 4. prints the table ($OUT/table.txt); every result in $OUT/results.json, logs in $OUT/logs.tar.gz.
# HSX_E2E_STAGES (default A,B): A = server A (all checks + capture cost), A1 = server A, test 1 only,
# B = server B. (A float32 server cannot be the reference: sgl_kernel's rmsnorm has no fp32 kernel.)
set -u
STAGES=${HSX_E2E_STAGES:-A,B}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1
R=$(pwd)
OUT=${OUT:-/tmp/hsx-e2e-out}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
say() { echo "[$(el)s] $*" | tee -a "$OUT/steps.log"; }

source .sglang-bundle/install-on-device.sh .sglang-bundle > "$OUT/install.log" 2>&1
cat "$OUT/install.log" | tail -2
export PYTHONPATH="$R:${PYTHONPATH:-}"
export HSX_SGLANG_STATS_SECONDS=2
say "installed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
nproc >> "$OUT/gpu.txt"

MODEL=/tmp/m8b
[ -f $MODEL/config.json ] || python3 scripts/device/make_llama.py 8b $MODEL 2>&1 | grep -v Writing | tee "$OUT/make_model.log"
say "model ready"
LENS=1,2,3,17,255,1000,2047,2048,2049,3000,4096,4097,6000,8192
HSX_REF_FP32=1 python3 scripts/device/hf_reference.py $MODEL /dev/shm/hsx-ref $LENS "" 2>&1 | grep -v Warning | tee "$OUT/hf_reference.log"
say "HF reference done"

SPID=""
launch() {  # launch NAME PORT [sglang args...]
  local name=$1 port=$2; shift 2
  rm -rf "/dev/shm/hsx-$name"
  setsid python3 -m workers.engines.sglang.launcher --model-path $MODEL --port "$port" \
    --dump-dir "/dev/shm/hsx-$name" --attention-backend triton --sampling-backend pytorch \
    --grammar-backend none --disable-cuda-graph --mem-fraction-static 0.8 --dtype bfloat16 "$@" > "$OUT/server_$name.log" 2>&1 &
  SPID=$!
  for i in $(seq 1 400); do
    [ "$(el)" -gt 540 ] && break
    if curl -sf "localhost:$port/health" > /dev/null 2>&1 && curl -sf "localhost:$port/hsx/info" > "$OUT/info_$name.json"; then
      say "server $name up after ${i}s: $(cat "$OUT/info_$name.json")"; return 0
    fi
    kill -0 $SPID 2> /dev/null || { say "server $name died"; tail -60 "$OUT/server_$name.log"; return 1; }
    sleep 1
  done
  say "server $name timeout"; tail -60 "$OUT/server_$name.log"; return 1
}
stop() {
  [ -n "$SPID" ] || return 0
  kill -TERM -- -"$SPID" 2> /dev/null
  for i in $(seq 1 30); do kill -0 $SPID 2> /dev/null || break; sleep 1; done
  kill -KILL -- -"$SPID" 2> /dev/null
  SPID=""
  for i in $(seq 1 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${used:-0}" -lt 2000 ] && break; sleep 1
  done
  say "server stopped (GPU memory used ${used:-?} MiB)"
}
hsxlog() {  # the plugin's own log lines of a server
  grep -E "hsx" "$OUT/server_$1.log" | grep -vE "POST|GET" | tail -8
  echo "dropped partial captures: $(grep -c 'dropped partial capture' "$OUT/server_$1.log")"
}

if has A1 && launch A 30001 --disable-radix-cache --chunked-prefill-size 2048; then
  HSX_E2E_ONLY_TEST1=1 python3 scripts/device/sglang_checks.py correctness http://127.0.0.1:30001 /dev/shm/hsx-A \
    /dev/shm/hsx-ref "$OUT/correctness.json" 2>&1 | tail -5
  say "test 1 (bf16) done"
fi
if has A && launch A 30001 --disable-radix-cache --chunked-prefill-size 2048; then
  python3 scripts/device/sglang_checks.py correctness http://127.0.0.1:30001 /dev/shm/hsx-A /dev/shm/hsx-ref "$OUT/correctness.json" 2>&1 | tail -5
  say "correctness done"
  rm -rf /dev/shm/hsx-A/*
  python3 bench/sglang_capture.py --url http://127.0.0.1:30001 --dump-dir /dev/shm/hsx-A --rounds 2 \
    --out "$OUT/bench_A_chunk2048_radix_off.json" 2>&1 | tail -3
  say "bench A done"
  sleep 3; hsxlog A | tee "$OUT/hsx_A.txt"
fi
stop

if has B && [ "$(el)" -lt 470 ] && launch B 30002; then
  python3 scripts/device/sglang_checks.py radix http://127.0.0.1:30002 /dev/shm/hsx-B "$OUT/radix.json" 2>&1 | tail -3
  say "radix done"
  rm -rf /dev/shm/hsx-B/*
  [ "$(el)" -lt 530 ] && python3 bench/sglang_capture.py --url http://127.0.0.1:30002 --dump-dir /dev/shm/hsx-B --rounds 2 --extra-key \
    --out "$OUT/bench_B_default_chunk_radix_on_extra_key.json" 2>&1 | tail -3
  say "bench B done"
  sleep 3; hsxlog B | tee "$OUT/hsx_B.txt"
else
  say "server B skipped or failed"
fi
stop
rm -rf /dev/shm/hsx-A /dev/shm/hsx-B
say "all done"
echo "==================== RESULTS ===================="
python3 scripts/device/sglang_checks.py report "$OUT" | tee "$OUT/table.txt"
# Few files come back from a device call: one results.json, the table, and the rest in one archive.
(cd "$OUT" && tar czf logs.tar.gz --remove-files $(ls | grep -vE '^(results.json|table.txt|logs.tar.gz|run.log)$'))
