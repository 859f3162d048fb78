#!/usr/bin/env bash
# Runs the tests N times and counts the failures per test id: the proof that the suite is deterministic.
#
#   scripts/flake_hunt.sh [-n RUNS] [--hog] [--workers W] [--keep DIR] [-- PYTEST_ARGS...]
#
#   -n RUNS      how many runs (default 5), back to back
#   --hog        a CPU hog pinned to one core runs beside every run (a busy loop; killed at the end),
#                so the tests see the loaded host that flakes come from
#   --workers W  pytest-xdist processes (default: $PYTEST_WORKERS or 2, as `make test`)
#   --keep DIR   where each run's log and JUnit XML go (default: a new folder under /tmp)
#   PYTEST_ARGS  what to run (default: the whole suite), e.g. -- tests/test_faults.py tests/test_soak.py
#
# Each run's failures and errors are read from its JUnit XML; the summary prints every failing test id with
# the number of runs it failed in, and the script exits 1 if any run failed. It holds the shared CPU lock
# (/tmp/hsx-cpu.lock) exclusively for the whole hunt, so nobody else's tests run beside it.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=5
HOG=0
WORKERS="${PYTEST_WORKERS:-2}"
KEEP=""
while [ $# -gt 0 ]; do
  case "$1" in
    -n) RUNS="$2"; shift 2 ;;
    --hog) HOG=1; shift ;;
    --workers) WORKERS="$2"; shift 2 ;;
    --keep) KEEP="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
PY="${PYTHON:-.venv/bin/python}"
LOCK=/tmp/hsx-cpu.lock
if [ -z "${HSX_FLAKE_HUNT_LOCKED:-}" ]; then
  export HSX_FLAKE_HUNT_LOCKED=1
  exec flock -x "$LOCK" "$0" -n "$RUNS" $([ "$HOG" = 1 ] && echo --hog) --workers "$WORKERS" \
    ${KEEP:+--keep "$KEEP"} -- "$@"
fi
OUT="${KEEP:-$(mktemp -d /tmp/flake-hunt.XXXXXX)}"
mkdir -p "$OUT"

HOG_PID=""
stop_hog() {
  if [ -n "$HOG_PID" ]; then
    kill "$HOG_PID" 2>/dev/null || true
    wait "$HOG_PID" 2>/dev/null || true
    HOG_PID=""
  fi
}
trap stop_hog EXIT
if [ "$HOG" = 1 ]; then
  # A busy loop on the first core: the tests get one core and a share of it, as under another load.
  taskset -c 0 bash -c 'while :; do :; done' &
  HOG_PID=$!
  echo "flake_hunt: CPU hog $HOG_PID on core 0"
fi

echo "flake_hunt: $RUNS run(s) of: pytest -n $WORKERS ${*:-(the whole suite)}; logs in $OUT"
for i in $(seq 1 "$RUNS"); do
  start=$(date +%s)
  set +e
  "$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadgroup --durations=10 \
    --junitxml="$OUT/run-$i.xml" "$@" >"$OUT/run-$i.log" 2>&1
  code=$?
  set -e
  echo "flake_hunt: run $i/$RUNS exit $code in $(( $(date +%s) - start ))s ($(tail -n 1 "$OUT/run-$i.log"))"
done
stop_hog

"$PY" - "$OUT" "$RUNS" <<'PYEOF'
import collections, pathlib, sys
import xml.etree.ElementTree as ET

out, runs = pathlib.Path(sys.argv[1]), int(sys.argv[2])
failed: collections.Counter[str] = collections.Counter()
tests = 0
missing = []
for i in range(1, runs + 1):
    path = out / f"run-{i}.xml"
    if not path.exists():
        missing.append(i)
        continue
    seen = set()
    for case in ET.parse(path).iter("testcase"):
        tests += 1
        if case.find("failure") is not None or case.find("error") is not None:
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            seen.add(name)
    failed.update(seen)
print(f"flake_hunt: {runs} run(s), {tests} test results, {sum(failed.values())} failure(s)")
for name, count in failed.most_common():
    print(f"  {count}/{runs}  {name}")
if missing:
    print(f"flake_hunt: run(s) {missing} wrote no JUnit XML (see their logs)")
sys.exit(1 if failed or missing else 0)
PYEOF
