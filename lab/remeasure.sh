#!/usr/bin/env bash
# Re-measure the Xeon figures of docs/performance.md with the product as it is, record each as
# lab/results/NAME.json (lab/figures.py --record, or the script's own --out), then regenerate
# README.md and docs/performance.md (lab/figures.py). Run it on a quiet 2-core machine of the
# kind the figures name (Intel Xeon with AMX): about 20 minutes, nothing else running.
#
#   lab/remeasure.sh             # every step; refuses to start at a load average above 1
#   lab/remeasure.sh --dry-run   # print each step's commands, run nothing
#
# Steps (each prints what it does; a failed step stops the script and names itself):
#   build                 the demo spec's and the demo head spec's engines (a no-op when up to date)
#   engine-floor-vs-hf    the demo target against transformers' generate, batch 1 (lab/engine_floor.py)
#   xeon-schedule-grid    the demo pair's k x concurrency grid in process and its recommended schedule
#   xeon-break-even       the demo head's step costs at k=3 (the acceptance length it must reach)
#   xeon-served           the demo pair served on Triton, concurrency 1, 2, 4, 8
#   xeon-served-schedule  the same with the grid's recommended speculative.schedule
#   figures               README.md and docs/performance.md regenerated from the result files
#
# Settings (environment): SPEC (the demo pair), HEAD_SPEC (the demo's EAGLE-3 head), FLOOR_SPEC
# (engine-floor-vs-hf's spec, SPEC unless set: its decode profile needs token ids up to ~2100),
# RESULTS (where the result files go; anything but lab/results skips the figures step and keeps
# the cached kernel choices), FLOOR_PROMPTS, MAX_TOKENS, HTTP_PORT / GRPC_PORT / METRICS_PORT (the
# server's), REMEASURE_ANY_LOAD=1 (start at any load: a check of the script, not a measurement).
# A check on the tiny pair:
#   SPEC=engine_specs/tiny-llama.yaml HEAD_SPEC=engine_specs/tiny-llama.yaml \
#     FLOOR_SPEC=engine_specs/smollm2-135m-cpu.yaml RESULTS=/tmp/r MAX_TOKENS=8 FLOOR_PROMPTS=1 \
#     REMEASURE_ANY_LOAD=1 lab/remeasure.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PY:-.venv/bin/python}
TRTSPEC=${TRTSPEC:-.venv/bin/trtspec}
SPEC=${SPEC:-engine_specs/smollm2-135m-cpu.yaml}
HEAD_SPEC=${HEAD_SPEC:-engine_specs/smollm2-135m-eagle3-demo.yaml}
FLOOR_SPEC=${FLOOR_SPEC:-$SPEC}
RESULTS=${RESULTS:-lab/results}
FLOOR_PROMPTS=${FLOOR_PROMPTS:-6}
MAX_TOKENS=${MAX_TOKENS:-64}
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
METRICS_PORT=${METRICS_PORT:-8002}
URL=127.0.0.1:$GRPC_PORT
DRY_RUN=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY_RUN=1 ;;
  *) echo "Error: unknown argument '$1'; run lab/remeasure.sh or lab/remeasure.sh --dry-run" >&2; exit 2 ;;
esac

load=$(cut -d' ' -f1 /proc/loadavg)
if [ "$DRY_RUN" = 0 ] && [ "${REMEASURE_ANY_LOAD:-0}" != 1 ] && "$PY" -c "import sys; sys.exit(float('$load') <= 1.0)"; then
  echo "Error: load average $load: other processes would distort every timing; run on a quiet machine" \
    "(REMEASURE_ANY_LOAD=1 runs anyway, for a check of the script only)" >&2
  exit 2
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/remeasure.XXXXXX")
PID_FILE=$WORK/server.json
SCHEDULE_SPEC=$(dirname "$SPEC")/.remeasure-schedule.yaml  # beside SPEC: its relative paths hold
STEP=start

cleanup() {
  if [ -f "$PID_FILE" ]; then "$TRTSPEC" stop --pid-file "$PID_FILE" || true; fi
  rm -f "$SCHEDULE_SPEC"
  rm -rf "$WORK"
}
failed() {
  echo "Error: step '$STEP' failed (exit $1); its output is above. Fix that, then run lab/remeasure.sh again." >&2
}
trap 'rc=$?; [ $rc -eq 0 ] || failed $rc; cleanup' EXIT

step() {
  STEP=$1
  echo
  echo "== step $STEP: $2 (load average $(cut -d' ' -f1 /proc/loadavg)) =="
}

# Print a command, then run it (only print it with --dry-run).
run() {
  echo "+ $*"
  [ "$DRY_RUN" = 1 ] || "$@"
}

# lab/results-style result file NAME from a `trtspec bench --out` folder's bench.json.
record() {  # NAME FOLDER COMMAND
  run "$PY" -m lab.figures --record "$1" --from "$2/bench.json" --command "$3" --results "$RESULTS"
}

serve() {  # SPEC
  run "$TRTSPEC" serve "$1" --detach --pid-file "$PID_FILE" --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" \
    --metrics-port "$METRICS_PORT"
}

stop() {
  run "$TRTSPEC" stop --pid-file "$PID_FILE"
}

mkdir -p "$RESULTS"

REAL=0
if [ "$(realpath -m "$RESULTS")" = "$ROOT/lab/results" ]; then REAL=1; fi

step build "build the engines of $SPEC and $HEAD_SPEC (no-op when up to date); forget cached kernel choices"
if [ "$REAL" = 1 ]; then
  # The engines choose their Linear kernels by timing them at load and cache the choice per
  # machine; a choice cached on a busy machine would stand in every figure below.
  run rm -f "$("$PY" -c 'from trtspec.cache import cache_root; print(cache_root())')/kernels.json"
fi
run "$TRTSPEC" build "$SPEC"
run "$TRTSPEC" build "$HEAD_SPEC"

step engine-floor-vs-hf "the target of $FLOOR_SPEC against transformers, $FLOOR_PROMPTS prompts x $MAX_TOKENS tokens, batch 1 (~3 min)"
run "$PY" -m lab.engine_floor --spec "$FLOOR_SPEC" --limit "$FLOOR_PROMPTS" --max-tokens "$MAX_TOKENS" \
  --out "$RESULTS/engine-floor-vs-hf.json"

step xeon-schedule-grid "$SPEC in process: k = 1, 3, 5 and target-only at concurrency 1, 2, 4, 8 (~7 min)"
args=(--schedule --sweep 1,3,5 -c 1,2,4,8 --max-tokens "$MAX_TOKENS")
run "$TRTSPEC" bench "$SPEC" "${args[@]}" --out "$WORK/grid"
record xeon-schedule-grid "$WORK/grid" "trtspec bench $SPEC ${args[*]}"

step xeon-break-even "$HEAD_SPEC's head at k=3: step costs, one pass over the prompts at concurrency 1 (~2 min)"
args=(-k 3 --sweep none -c 1 --max-tokens "$MAX_TOKENS")
run "$TRTSPEC" bench "$HEAD_SPEC" "${args[@]}" --out "$WORK/break-even"
record xeon-break-even "$WORK/break-even" "trtspec bench $HEAD_SPEC ${args[*]}"

step xeon-served "$SPEC served on Triton, bench over gRPC at concurrency 1, 2, 4, 8 (~3 min)"
args=(--url "$URL" --sweep none -c 1,2,4,8 --max-tokens "$MAX_TOKENS")
serve "$SPEC"
run "$TRTSPEC" bench "$SPEC" "${args[@]}" --out "$WORK/served"
stop
record xeon-served "$WORK/served" "trtspec serve $SPEC --detach
trtspec bench $SPEC ${args[*]}"

step xeon-served-schedule "$SPEC with the grid's recommended schedule, served, the same bench (~3 min)"
if [ "$DRY_RUN" = 1 ]; then
  schedule="<the schedule step xeon-schedule-grid recommends>"
  echo "+ write $SCHEDULE_SPEC: $SPEC with speculative.schedule: $schedule"
else
  schedule=$("$PY" - "$SPEC" "$RESULTS/xeon-schedule-grid.json" "$SCHEDULE_SPEC" <<'EOF'
import json, sys
import yaml
spec, grid, out = sys.argv[1:]
schedule = {int(n): k for n, k in json.load(open(grid))["values"]["schedule"]["spec"]["schedule"].items()}
data = yaml.safe_load(open(spec))
data["speculative"]["schedule"] = schedule
with open(out, "w") as f:
    f.write(f"# {spec} with the schedule lab/remeasure.sh measured; removed when the script ends\n")
    yaml.safe_dump(data, f, sort_keys=False)
print("{" + ", ".join(f"{n}: {k}" for n, k in schedule.items()) + "}")
EOF
)
  echo "+ wrote $SCHEDULE_SPEC: $SPEC with speculative.schedule: $schedule"
fi
serve "$SCHEDULE_SPEC"
run "$TRTSPEC" bench "$SCHEDULE_SPEC" "${args[@]}" --out "$WORK/served-schedule"
stop
record xeon-served-schedule "$WORK/served-schedule" "trtspec serve SPEC --detach  # $SPEC with speculative.schedule: $schedule
trtspec bench SPEC ${args[*]}"

step figures "regenerate README.md and docs/performance.md from $RESULTS"
if [ "$REAL" = 1 ]; then
  run "$PY" -m lab.figures
else
  echo "skipped: results in $RESULTS, not lab/results"
fi
STEP=done
echo
echo "== done: re-measured engine-floor-vs-hf, xeon-schedule-grid, xeon-break-even, xeon-served, xeon-served-schedule =="
