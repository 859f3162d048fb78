#!/usr/bin/env bash
# The SGLang capture under parallel layouts on ONE GPU, in ONE device call (run from the repository root):
#   carry: [".sglang-bundle"]      command: bash scripts/device/run_parallel_layouts.sh
# NOT YET RUN ON A GPU (written 2026-12-07). It tries the "two-node idea" of issue 41: one launcher per
# simulated node (--nnodes N --node-rank i, one --dist-init-addr), each process with its own NCCL_HOSTID so
# that NCCL takes the ranks for other hosts and talks over loopback sockets instead of refusing two ranks
# on one GPU ("Duplicate GPU detected"); --disable-custom-all-reduce and a low --mem-fraction-static.
#
# Stages (each logged with its start and length in stages.log; a stage is skipped, saying so, when the time
# left is below what it needs; everything is stopped at HSX_LAYOUTS_BUDGET, default 540 s after the start):
#   0. install the SGLang 0.5.17 bundle; make a random-init Llama of the 1B shape (make_llama.py 1b) and a
#      DeepSeek-V3-shaped random MoE (arch_models.py: 8 layers, hidden 1,024, MLA, 16 experts + 1 shared,
#      layer 0 dense), each with a byte-level tokenizer.json;
#   1. refusals at launch, no GPU work: --pp-size 2, and --moe-a2a-backend deepep at attention TP 2;
#   2. Llama TP 1 (the baseline): the prompt set (1..1,500 tokens, with plain rids and /health_generate, at
#      once, chunked prefill 256);
#   3. Llama TP 2 over two simulated nodes: the same prompts; dumps compared with stage 2's; hsx verify
#      --reference (the verification prompts against a transformers fp32 forward); /hsx/info's layout.
#      DeepSeek-V3 TP 1 (stage 4's server) starts once both ranks have sized their memory pools;
#   4. DeepSeek-V3 TP 1 (the baseline): the prompt set;
#   5. DeepSeek-V3 with DP attention 2x2 (--tp 4 --dp 2 --enable-dp-attention: two DP groups of attention
#      TP 2) over four simulated nodes, --shared-dump-dir (one host: one /dev/shm): the same prompts; each
#      dump says which DP group's leader wrote it (both must have); compared with stage 4's; hsx verify
#      --reference;
#   6. if time is left: DeepSeek-V3 with DP attention at attention TP 1 (--tp 2 --dp 2) over two nodes;
#   7. if time is left: node 1 runs plain SGLang: node 0's hsx launcher must refuse (peers.py).
# Expected: about 8 to 9 minutes (two server launches of each model at 40 to 150 s; the first DeepSeek
# launch compiles its kernels); the budget stops it before 10.
# Output: ONE tarball, $OUT/parallel_layouts.tar.gz: stages.log, verdicts.txt, gpu.txt, install.log,
# server logs (one per simulated node), /hsx/info of each server, send_*.json (every prompt's dump: rows,
# ids exact, DP group), compare_*.json (per tensor: mean/share/min cosine against the TP 1 dumps, largest
# relative difference), verify_*.json (hsx verify --reference's checks), refuse_*.log.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s)
BUDGET=${HSX_LAYOUTS_BUDGET:-540}
R=$(pwd)
OUT=${OUT:-/tmp/hsx-layouts-out}
W="$OUT/parallel_layouts"
mkdir -p "$W"
WORK=/tmp/hsx-layouts
SHM=/dev/shm/hsx-layouts
mkdir -p "$WORK" "$SHM"
CHECK="bounded python3 scripts/device/layout_checks.py"
COMMON=(--attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-cuda-graph
  --disable-radix-cache --dtype bfloat16 --chunked-prefill-size 256 --context-length 4096 --host 127.0.0.1)
# one simulated node = one process on the one GPU, seen by NCCL as another host, over loopback sockets
SIM_NCCL=(NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
  NCCL_NVLS_ENABLE=0)

el() { echo $(( $(date +%s) - START )); }
left() { echo $(( START + BUDGET - $(date +%s) )); }
say() { echo "[$(el)s] $*" | tee -a "$W/stages.log"; }
STAGE="" ; STAGE_T0=0
stage() {  # stage NAME SECONDS_NEEDED: false (and logged) when the time left is short
  STAGE=$1; STAGE_T0=$(date +%s)
  if [ "$(left)" -lt "$2" ]; then
    say "SKIP $1: $(left)s left, it needs about $2s"; echo "$1: skipped (time)" >> "$W/verdicts.txt"; return 1
  fi
  say "BEGIN $1"
}
bounded() {  # a command, stopped 15 s before the budget runs out (so the tarball is always written)
  local t=$(( $(left) - 15 ))
  [ "$t" -gt 0 ] || { say "no time left for: $*"; return 124; }
  timeout -k 5 "$t" "$@"
}
verdict() { say "END $STAGE after $(( $(date +%s) - STAGE_T0 ))s: $*"; echo "$STAGE: $*" >> "$W/verdicts.txt"; }
leaders() {  # leaders NAME NODES: how many schedulers of each node installed the capture
  local n out=""
  for n in $(seq 0 $(( $2 - 1 ))); do out="$out node$n=$(grep -c 'hsx capture on' "$W/server_$1_node$n.log" 2> /dev/null)"; done
  echo "capturing schedulers:$out"
}

PGIDS=()
launch() {  # launch NAME NODE NNODES HTTP_PORT MODEL MEM_FRACTION [more args]: one simulated node's launcher
  local name=$1 node=$2 nnodes=$3 port=$4 model=$5 mem=$6; shift 6
  local envs=() multi=()
  if [ "$nnodes" -gt 1 ]; then
    envs=("${SIM_NCCL[@]}" "NCCL_HOSTID=hsx-sim-$name-node$node")
    multi=(--nnodes "$nnodes" --node-rank "$node" --dist-init-addr "127.0.0.1:$DIST_PORT" --disable-custom-all-reduce)
  fi
  setsid env ${envs[@]+"${envs[@]}"} python3 -m workers.engines.sglang.launcher --model-path "$model" \
    --port "$port" --dump-dir "$SHM/$name" --mem-fraction-static "$mem" "${COMMON[@]}" ${multi[@]+"${multi[@]}"} "$@" \
    > "$W/server_${name}_node$node.log" 2>&1 &
  PGIDS+=($!)
}
pools_sized() {  # pools_sized NAME NODES: every node's scheduler has allocated its KV pool
  local n
  for n in $(seq 0 $(( $2 - 1 ))); do grep -q "Memory pool end" "$W/server_$1_node$n.log" 2> /dev/null || return 1; done
}
wait_pools() {  # wait_pools NAME NODES SECONDS
  local i
  for i in $(seq 1 "$3"); do pools_sized "$1" "$2" && return 0; [ "$(left)" -lt 20 ] && return 1; sleep 1; done
  return 1
}
wait_up() {  # wait_up NAME HTTP_PORT SECONDS: /health and /hsx/info answer on node 0
  local i
  for i in $(seq 1 "$3"); do
    if curl -sf "127.0.0.1:$2/health" > /dev/null 2>&1 && curl -sf "127.0.0.1:$2/hsx/info" > "$W/info_$1.json"; then
      say "$1 up after ${i}s: layout $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["extra"]["parallel_layout"])' "$W/info_$1.json")"
      return 0
    fi
    [ "$(left)" -lt 15 ] && break
    sleep 1
  done
  say "$1 did not come up"; tail -30 "$W/server_$1_node0.log"; return 1
}
stop_servers() {  # every launched process group, by its id
  local pg
  for pg in ${PGIDS[@]+"${PGIDS[@]}"}; do kill -TERM -- "-$pg" 2> /dev/null; done
  for _ in $(seq 1 20); do
    local alive=0
    for pg in ${PGIDS[@]+"${PGIDS[@]}"}; do kill -0 -- "-$pg" 2> /dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 1
  done
  for pg in ${PGIDS[@]+"${PGIDS[@]}"}; do kill -KILL -- "-$pg" 2> /dev/null; done
  PGIDS=()
}
pack() {
  stop_servers
  rm -rf "$SHM"
  say "total $(el)s"
  cat "$W/verdicts.txt" 2> /dev/null
  tar czf "$OUT/parallel_layouts.tar.gz" -C "$OUT" parallel_layouts && rm -rf "$W"
  ls -la "$OUT"
}
trap pack EXIT

# ---- 0. install and models ---------------------------------------------------------------------------
stage install 0
source .sglang-bundle/install-on-device.sh .sglang-bundle > "$W/install.log" 2>&1
export PYTHONPATH="$R:${PYTHONPATH:-}"
export HSX_SGLANG_STATS_SECONDS=5
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$W/gpu.txt" 2>&1
python3 -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)" >> "$W/gpu.txt" 2>&1
verdict "$(tail -1 "$W/install.log"); $(tr '\n' ' ' < "$W/gpu.txt")"

LLAMA=$WORK/llama-1b
DSV3=$WORK/deepseek-v3
stage models 400
[ -f "$LLAMA/config.json" ] || bounded python3 scripts/device/make_llama.py 1b "$LLAMA" > "$W/models.log" 2>&1
if [ ! -f "$DSV3/config.json" ]; then
  bounded python3 -c "import sys; sys.path.insert(0, 'scripts/device'); import arch_models as am; am.make_model('deepseek_v3', sys.argv[1])" "$DSV3" >> "$W/models.log" 2>&1
  bounded python3 scripts/device/make_llama.py tokenizer "$DSV3" >> "$W/models.log" 2>&1
fi
verdict "llama $(ls "$LLAMA" | wc -l) files, deepseek $(ls "$DSV3" | wc -l) files"

# ---- 1. refusals at launch ---------------------------------------------------------------------------
if stage refusals 380; then
  timeout -k 5 60 python3 -m workers.engines.sglang.launcher --model-path "$LLAMA" --tp 2 --pp-size 2 \
    "${COMMON[@]}" > "$W/refuse_pp2.log" 2>&1
  pp=$?
  timeout -k 5 60 python3 -m workers.engines.sglang.launcher --model-path "$DSV3" --tp 2 --moe-a2a-backend deepep \
    "${COMMON[@]}" > "$W/refuse_deepep.log" 2>&1
  a2a=$?
  verdict "pp2 exit $pp ($(grep -c 'different stages' "$W/refuse_pp2.log") reason lines); deepep at attention TP 2 exit $a2a ($(grep -c 'attention TP 2' "$W/refuse_deepep.log") reason lines); expected exit 2 with the reason"
fi

# ---- 2. Llama TP 1 -----------------------------------------------------------------------------------
if stage llama-tp1 330; then
  launch llama-tp1 0 1 30101 "$LLAMA" 0.3
  wait_up llama-tp1 30101 180 && $CHECK send http://127.0.0.1:30101 "$SHM/llama-tp1" llama-tp1 128256 "$W/send_llama-tp1.json"
  verdict "send exit $?"
  stop_servers
fi

# ---- 3. Llama TP 2 over two simulated nodes (and DeepSeek TP 1's launch once their pools are sized) -----
DSV3_TP1_LAUNCHED=0
if stage llama-tp2-2nodes 270; then
  DIST_PORT=29610
  launch llama-tp2 0 2 30111 "$LLAMA" 0.15 --tp 2
  launch llama-tp2 1 2 30112 "$LLAMA" 0.15 --tp 2
  if wait_pools llama-tp2 2 150 && [ "$(left)" -gt 200 ]; then
    launch dsv3-tp1 0 1 30121 "$DSV3" 0.2
    DSV3_TP1_LAUNCHED=1
  fi
  if wait_up llama-tp2 30111 150; then
    $CHECK send http://127.0.0.1:30111 "$SHM/llama-tp2" llama-tp2 128256 "$W/send_llama-tp2.json"; s=$?
    $CHECK compare "$W/send_llama-tp1.json" "$W/send_llama-tp2.json" "$W/compare_llama-tp2.json"; c=$?
    $CHECK verify http://127.0.0.1:30111 "$SHM/llama-tp2" "$W/verify_llama-tp2.json"; v=$?
    verdict "send exit $s, compare with TP 1 exit $c, verify --reference exit $v; $(leaders llama-tp2 2) (expected node0=1 node1=0)"
  else
    verdict "did not come up"
  fi
  for pg in "${PGIDS[@]:0:2}"; do kill -TERM -- "-$pg" 2> /dev/null; done  # TP 2 only; DeepSeek goes on
fi

# ---- 4. DeepSeek-V3 TP 1 -----------------------------------------------------------------------------
if stage dsv3-tp1 200; then
  [ $DSV3_TP1_LAUNCHED = 1 ] || launch dsv3-tp1 0 1 30121 "$DSV3" 0.2
  wait_up dsv3-tp1 30121 180 && $CHECK send http://127.0.0.1:30121 "$SHM/dsv3-tp1" dsv3-tp1 32000 "$W/send_dsv3-tp1.json"
  verdict "send exit $?"
fi
stop_servers

# ---- 5. DeepSeek-V3, DP attention 2x2 over four simulated nodes ---------------------------------------
if stage dsv3-dpattn-2x2 160; then
  DIST_PORT=29630
  for n in 0 1 2 3; do
    launch dsv3-dp2x2 "$n" 4 $(( 30131 + n )) "$DSV3" 0.1 --tp 4 --dp 2 --enable-dp-attention --shared-dump-dir
  done
  if wait_up dsv3-dp2x2 30131 "$(( $(left) - 40 ))"; then
    $CHECK send http://127.0.0.1:30131 "$SHM/dsv3-dp2x2" dsv3-dp2x2 32000 "$W/send_dsv3-dp2x2.json"; s=$?
    $CHECK compare "$W/send_dsv3-tp1.json" "$W/send_dsv3-dp2x2.json" "$W/compare_dsv3-dp2x2.json"; c=$?
    $CHECK verify http://127.0.0.1:30131 "$SHM/dsv3-dp2x2" "$W/verify_dsv3-dp2x2.json"; v=$?
    verdict "send exit $s, compare with TP 1 exit $c, verify --reference exit $v; $(leaders dsv3-dp2x2 4) (expected 1 0 1 0); dumps by DP group: $(python3 -c 'import collections,json,sys; print(dict(collections.Counter(str(r.get("dp_rank")) for r in json.load(open(sys.argv[1]))["prompts"].values())))' "$W/send_dsv3-dp2x2.json" 2>&1 | tail -1)"
  else
    verdict "did not come up"
  fi
  stop_servers
fi

# ---- 6. DeepSeek-V3, DP attention at attention TP 1 over two simulated nodes -------------------------
if stage dsv3-dpattn-tp2-dp2 130; then
  DIST_PORT=29650
  for n in 0 1; do
    launch dsv3-dp2 "$n" 2 $(( 30141 + n )) "$DSV3" 0.15 --tp 2 --dp 2 --enable-dp-attention --shared-dump-dir
  done
  if wait_up dsv3-dp2 30141 "$(( $(left) - 30 ))"; then
    $CHECK send http://127.0.0.1:30141 "$SHM/dsv3-dp2" dsv3-dp2 32000 "$W/send_dsv3-dp2.json"; s=$?
    $CHECK compare "$W/send_dsv3-tp1.json" "$W/send_dsv3-dp2.json" "$W/compare_dsv3-dp2.json"; c=$?
    verdict "send exit $s, compare with TP 1 exit $c; $(leaders dsv3-dp2 2) (expected 1 1)"
  else
    verdict "did not come up"
  fi
  stop_servers
fi

# ---- 7. node 1 runs plain SGLang: node 0 must refuse ------------------------------------------------
if stage plain-node1 90; then
  DIST_PORT=29670
  HSX_SGLANG_PEER_WAIT_SECONDS=20 launch plain-node1 0 2 30151 "$LLAMA" 0.15 --tp 2
  setsid env "${SIM_NCCL[@]}" NCCL_HOSTID=hsx-sim-plain-node1-node1 python3 -m sglang.launch_server \
    --model-path "$LLAMA" --port 30152 --mem-fraction-static 0.15 "${COMMON[@]}" --skip-tokenizer-init \
    --enforce-disable-flashinfer-allreduce-fusion --cuda-graph-backend-prefill disabled --tp 2 --nnodes 2 \
    --node-rank 1 --dist-init-addr "127.0.0.1:$DIST_PORT" --disable-custom-all-reduce \
    > "$W/server_plain-node1_node1.log" 2>&1 &
  PGIDS+=($!)
  for _ in $(seq 1 $(( $(left) - 15 ))); do
    grep -q "refusing this multi-node launch" "$W/server_plain-node1_node0.log" 2> /dev/null && break
    sleep 1
  done
  verdict "node 0: $(grep -h -o 'refusing this multi-node launch: .*' "$W/server_plain-node1_node0.log" | head -1 | cut -c1-200)"
  stop_servers
fi
