#!/usr/bin/env bash
# Issue 26 item 4 on the lent H200, one shape per device call (run from the repository root):
#   carry: [".sglang-bundle", ".whl", ".device"]
#   command: SHAPE=8b bash scripts/device/run_long_samples.sh      (8B-shaped Llama: 32 layers, hidden 4096)
#            SHAPE=h7168 bash scripts/device/run_long_samples.sh   (the 8B Llama widened to 7168, 16 layers)
# Needs what run_bench_e2e.sh needs (.sglang-bundle, .whl, .device/redis-server.xz; docs/sglang.md); psutil
# (the device's, or a wheel in .whl) for the RSS figures.
# It writes the model's config with a context of 133,120 positions (SGLang fills in random weights: the speed
# does not depend on their values), starts the patched SGLang engine (radix cache off, chunked prefill 8,192,
# so every long prompt is reassembled from chunks), then runs `hsx bench long` (bench/long.py): for each
# length (LENGTHS, default 32768,65536,131072; SAMPLES of each, default 4,2,1) plain prefill of the same
# prompts at the same concurrency, a keep job and a consume job (8 consumers checking every shard's sha256,
# the cap at CAP of the output, default 1.0), each sample a unit of its own on PROCESSES worker processes
# (default 4). Per job: tok/s against plain, rows exact (every sample holds exactly its prompt's tokens),
# the worker processes' peak RSS against its idle RSS and the bound tests/test_long_samples.py holds, the
# API's peak RSS, and the timeline. Results: $OUT/long.json (one line per length) and the table in
# $OUT/long.txt; logs (the server's, vmstat, the stack's) in $OUT/logs.tar.gz.
# Time: engine start 50-120 s; then at 8B about 2 x 25 s per length for the jobs and plain prefill, more at
# H=7168 (the 131,072-token row last: it is skipped when fewer than 150 s are left).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=$(pwd)
OUT=${OUT:-/tmp/hsx-bench-out}
mkdir -p "$OUT/logs"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }
SHAPE=${SHAPE:-8b}
LENGTHS=${LENGTHS:-32768,65536,131072}
SAMPLES=${SAMPLES:-4,2,1}
PROCESSES=${PROCESSES:-4}
CAP=${CAP:-1.0}
DEADLINE=${DEADLINE:-570}  # seconds after the start by which the script must be done
export HSX_SGLANG_WRITER_THREADS=${WRITERS:-8}

source .sglang-bundle/install-on-device.sh .sglang-bundle > "$OUT/logs/install.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hsx-site .whl/*.whl >> "$OUT/logs/install.log" 2>&1
export PYTHONPATH="$R:/tmp/hsx-site:${PYTHONPATH:-}"
mkdir -p /tmp/hsx-bin && xz -dc .device/redis-server.xz > /tmp/hsx-bin/redis-server && chmod +x /tmp/hsx-bin/redis-server
export PATH="/tmp/hsx-bin:$PATH"
say "installed; $(nproc) cores, $(free -g | awk '/Mem/{print $2}') GiB, /dev/shm $(df -h /dev/shm | awk 'NR==2{print $2}')"

MODEL=/tmp/llama-$SHAPE-long
if [ ! -f $MODEL/config.json ]; then
  python3 - "$MODEL" "$SHAPE" <<'PY'
import sys
from transformers import LlamaConfig
shape = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
         "h7168": dict(hidden_size=7168, intermediate_size=18432, num_hidden_layers=16, num_attention_heads=56)}
# 131,072-token prompts with room for SGLang's margin (the scheduler takes context - 7).
LlamaConfig(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=133120, rope_theta=500000.0,
            tie_word_embeddings=False, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"],
            **shape[sys.argv[2]]).save_pretrained(sys.argv[1])
PY
fi
say "model config ready ($SHAPE, context 133120)"

setsid python3 -m workers.engines.sglang.launcher --model-path $MODEL --port 30000 --dump-dir /dev/shm/hsx-dumps \
  --attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-cuda-graph \
  --disable-radix-cache --skip-tokenizer-init --load-format dummy --chunked-prefill-size 8192 \
  --writer-threads "$HSX_SGLANG_WRITER_THREADS" > "$OUT/logs/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 300); do
  kill -0 $SERVER 2> /dev/null || break
  curl -sf localhost:30000/health > /dev/null 2>&1 && curl -sf localhost:30000/hsx/info > /dev/null && break
  sleep 1
done
curl -sf localhost:30000/hsx/info > "$OUT/logs/info.json" || { say "engine failed"; tail -40 "$OUT/logs/server.log"; exit 1; }
say "engine up: $(python3 -c 'import json,sys; i=json.load(open(sys.argv[1])); print("context", i.get("context_length"), "max_prompt_tokens", i.get("max_prompt_tokens"), "max_dump_bytes", i.get("max_dump_bytes"))' "$OUT/logs/info.json")"

export HSX_BENCH_LOGS="$OUT/logs"
(vmstat -t 1 > "$OUT/logs/vmstat.txt" 2>&1 &)
# One bench run per length, so that a length that cannot finish in time leaves the others' rows.
IFS=, read -r -a LENS <<< "$LENGTHS"
IFS=, read -r -a COUNTS <<< "$SAMPLES"
for i in "${!LENS[@]}"; do
  L=${LENS[$i]}; N=${COUNTS[$i]}
  LEFT=$(( DEADLINE - ($(date +%s) - T0) ))
  NEED=$(( L >= 131072 ? 150 : 60 ))
  [ "$LEFT" -lt "$NEED" ] && { say "skipped $L: ${LEFT}s left"; continue; }
  timeout $(( LEFT - 15 )) python3 -m hsx.cli bench long --engine-url http://127.0.0.1:30000 --lengths "$L" \
    --samples "$N" --processes "$PROCESSES" --cap-fraction "$CAP" \
    2> "$OUT/logs/long.$SHAPE.$L.log" | tee "$OUT/logs/long.$SHAPE.$L.txt"
  say "length $L exit ${PIPESTATUS[0]}"
  grep '^{' "$OUT/logs/long.$SHAPE.$L.txt" | sed "s/^{/{\"shape\": \"$SHAPE\", /" >> "$OUT/long.json"
  grep -v '^{' "$OUT/logs/long.$SHAPE.$L.txt" | tail -n 2 >> "$OUT/long.txt"
done
kill -TERM -- -"$SERVER" 2> /dev/null
pkill -x vmstat 2> /dev/null
grep -E "hsx stats|oversize|error" "$OUT/logs/server.log" | tail -n 5 >> "$OUT/steps.log"
cat "$OUT/long.txt" 2> /dev/null
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
