#!/usr/bin/env bash
# The SGLang capture across architectures, in ONE device call (run from the repository root, carry
# .sglang-bundle; about 8 minutes, hard-stopped before 9):
#   bash scripts/device/run_arch_matrix.sh
# Random-init Llama, Qwen3, Qwen3-MoE, DeepSeek-V3 (MLA + MoE), GPT-OSS and Gemma 3/1/2 models, each
# served by a patched SGLang 0.5.17 (chunked prefill 256, radix cache off, --final-state pre for Llama and
# both for the others) under mixed captured/plain/health traffic, compared per tensor with transformers
# on the same weights in bf16 and fp32 (scripts/device/arch_matrix.py; figures: arch_stats.py).
# Each architecture runs in its own try: a failure is recorded in the table and the rest go on.
# Output in $OUT: table.md (the markdown table for docs/sglang.md), matrix.json (every figure),
# logs.tar.gz (server logs, install log).
# HSX_MATRIX_BUDGET: seconds from the start until everything is stopped (default 480);
# HSX_MATRIX_ARCHS: a comma-separated subset, in launch order (default: all, most important first).
set -u
export PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET=${HSX_MATRIX_BUDGET:-480}
R=$(pwd)
OUT=${OUT:-/tmp/hsx-matrix-out}
mkdir -p "$OUT/logs"

source .sglang-bundle/install-on-device.sh .sglang-bundle > "$OUT/logs/install.log" 2>&1
tail -2 "$OUT/logs/install.log"
export PYTHONPATH="$R:${PYTHONPATH:-}"
export HSX_SGLANG_STATS_SECONDS=5
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/logs/gpu.txt" 2>&1

LEFT=$(( START + BUDGET + 45 - $(date +%s) ))
timeout -k 10 "$LEFT" python3 scripts/device/arch_matrix.py --out "$OUT" --deadline $(( START + BUDGET )) \
  ${HSX_MATRIX_ARCHS:+--archs "$HSX_MATRIX_ARCHS"} 2>&1 | tee "$OUT/logs/matrix.log"
rc=${PIPESTATUS[0]}
# leftovers of a killed run: the process groups of the servers arch_matrix.py started, by their ids
if [ -f "$OUT/logs/server_pids" ]; then
  while read -r pid; do kill -KILL -- "-$pid" 2> /dev/null; done < "$OUT/logs/server_pids"
fi
rm -rf /dev/shm/hsx-matrix
[ -f "$OUT/table.md" ] || echo "no table: the matrix did not finish (rc=$rc); see logs.tar.gz"
(cd "$OUT" && tar czf logs.tar.gz --remove-files logs)
echo "total $(( $(date +%s) - START ))s, rc=$rc"
exit "$rc"
