#!/usr/bin/env bash
# Issue 23 on the lent H200, in ONE device call (run from the repository root):
#   carry: [".sglang-bundle", ".whl", ".device"]            (63 MiB in all with the tree: near the limit)
#   command: bash scripts/device/run_bench_regenerate.sh
# What it needs beyond the repo: what scripts/device/run_job_e2e.sh needs (.whl/, .device/redis-server.xz),
# and the default model's tokenizer as .device/tokenizer.tar.xz (its converted directory's 538 MB cannot
# travel): a regenerate job applies a chat template, so the model directory the engine serves must hold a
# tokenizer with one.
# It makes an 8B-shaped Llama with SmolLM2's vocabulary (49,152; SGLang fills in random weights) holding
# SmolLM2's tokenizer and chat template, starts two patched SGLang engines on the one GPU: the capture
# engine (radix cache off, port 30000) and one with its radix cache on (port 30001), each with a share of
# the memory, then runs `hsx bench regenerate` against them: the worker's client vs bare /generate, a whole
# regenerate job vs plain generation of the same prompts, and multi-turn generation on the capture engine vs
# the cache-on one. Results: $OUT/bench_regenerate.json (the bench's last line), $OUT/steps.log; tables,
# the stack's and the engines' logs in $OUT/logs.tar.gz.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=$(pwd)
OUT=${OUT:-/tmp/hsx-bench-out}
mkdir -p "$OUT/logs"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }
PROCESSES=${PROCESSES:-8}
CONCURRENCY=${CONCURRENCY:-16}
SAMPLES=${SAMPLES:-512}
MAX_NEW=${MAX_NEW:-256}
DEADLINE=${DEADLINE:-570}
# SEEDED=1 adds --enable-deterministic-inference, under which SGLang 0.5.17 honours sampling_seed (batch-
# invariant kernels, slower; triton attention keeps the radix cache on). The bench is greedy by default.
SEEDED=${SEEDED:-0}
TOKENIZER=$R/.hsx/models/smollm2-135m-instruct
if [ ! -f "$TOKENIZER/tokenizer.json" ] && [ -f .device/tokenizer.tar.xz ]; then
  # The tokenizer packed small (0.45 MB for 3.5), for a call whose carry is near its 64 MiB: made with
  # `tar cJf .device/tokenizer.tar.xz -C DIR tokenizer` from tokenizer.json, tokenizer_config.json and
  # chat_template.jinja of the converted default model.
  mkdir -p /tmp/hsx-tok && tar xJf .device/tokenizer.tar.xz -C /tmp/hsx-tok && TOKENIZER=/tmp/hsx-tok/tokenizer
fi
[ -f "$TOKENIZER/tokenizer.json" ] || { say "no tokenizer at $TOKENIZER (carry it)"; exit 1; }

source .sglang-bundle/install-on-device.sh .sglang-bundle > "$OUT/install.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hsx-site .whl/*.whl >> "$OUT/install.log" 2>&1
export PYTHONPATH="$R:/tmp/hsx-site:${PYTHONPATH:-}"
mkdir -p /tmp/hsx-bin && xz -dc .device/redis-server.xz > /tmp/hsx-bin/redis-server && chmod +x /tmp/hsx-bin/redis-server
export PATH="/tmp/hsx-bin:$PATH"
say "installed; $(nproc) cores"

MODEL=/tmp/m8b-regen
if [ ! -f $MODEL/config.json ]; then
  python3 - "$MODEL" "$TOKENIZER" <<'PY'
import shutil, sys
from pathlib import Path
from transformers import LlamaConfig
cfg = LlamaConfig(vocab_size=49152, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                  bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"])
cfg.save_pretrained(sys.argv[1])
for name in Path(sys.argv[2]).iterdir():
    if name.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
        shutil.copy(name, sys.argv[1])
PY
fi
say "model ready"

ENGINE_ARGS=(--model-path $MODEL --dtype bfloat16 --attention-backend triton --sampling-backend pytorch
  --grammar-backend none --skip-tokenizer-init --load-format dummy)
[ "$SEEDED" = 1 ] && ENGINE_ARGS+=(--enable-deterministic-inference)
# GRAPHS=1 keeps SGLang's decode CUDA graphs (production's setting; their capture costs start-up time); the
# default leaves them out, as run_bench_e2e.sh does. Both baselines run on the same engines either way.
[ "${GRAPHS:-0}" = 1 ] || ENGINE_ARGS+=(--disable-cuda-graph)
# One after the other, with rising fractions: --mem-fraction-static caps what the whole GPU holds when a
# server starts, the servers already there included (scripts/device/drafter_proof.sh found the same).
start_engine() {  # port, dump dir, memory fraction, extra args...
  local port=$1 dumps=$2 fraction=$3; shift 3
  setsid python3 -m workers.engines.sglang.launcher "${ENGINE_ARGS[@]}" --port $port --dump-dir $dumps \
    --mem-fraction-static $fraction "$@" \
    > "$OUT/logs/server-$port.log" 2>&1 &
  PIDS+=($!)
  for i in $(seq 1 300); do
    curl -sf localhost:$port/health > /dev/null 2>&1 && curl -sf localhost:$port/hsx/info > /dev/null && break
    sleep 1
  done
  curl -sf localhost:$port/hsx/info > "$OUT/logs/info-$port.json" || { say "engine $port failed"; tail -40 "$OUT/logs/server-$port.log"; exit 1; }
}
PIDS=()
start_engine 30000 /dev/shm/hsx-dumps 0.40 --disable-radix-cache   # the capture engine
# CACHE_ENGINE=0: the capture engine alone (a call short of time): the client and job parts, not the cache one.
CACHE_ARGS=(--cache-engine-url http://127.0.0.1:30001)
if [ "${CACHE_ENGINE:-1}" = 1 ]; then
  start_engine 30001 /dev/shm/hsx-dumps-cache 0.80                  # the same model, its radix cache on
else
  CACHE_ARGS=(--parts client,job)
fi
say "engines up"

export HSX_BENCH_LOGS="$OUT/logs"
LEFT=$(( DEADLINE - ($(date +%s) - T0) ))
timeout $(( LEFT - 20 )) python3 -m hsx.cli bench regenerate --engine-url http://127.0.0.1:30000 \
  "${CACHE_ARGS[@]}" --samples "$SAMPLES" --max-new-tokens "$MAX_NEW" \
  --processes "$PROCESSES" --concurrency "$CONCURRENCY" --conversations "$(( PROCESSES * CONCURRENCY ))" \
  --words "${WORDS:-150}" --turns 3 --user-tokens 256 --rounds 1 ${BENCH_ARGS:-} \
  2> "$OUT/logs/bench_regenerate.log" | tee "$OUT/logs/bench_regenerate.txt"
say "bench exit ${PIPESTATUS[0]}"
tail -n 1 "$OUT/logs/bench_regenerate.txt" >> "$OUT/bench_regenerate.json"
for pid in "${PIDS[@]}"; do kill -TERM -- -"$pid" 2> /dev/null; done
tail -n 5 "$OUT/logs/bench_regenerate.log"
mv "$OUT/install.log" "$OUT/logs/" 2> /dev/null
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
