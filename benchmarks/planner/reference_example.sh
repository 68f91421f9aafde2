#!/usr/bin/env bash
# The SkipPipe reference's own 20-node example (examples/clusters/skippipe_ref20.json
# + examples/jobs/skippipe_ref20.json): detour's plans against the reference's
# published collision-aware paths (examples/routes/skippipe_ref20_ca.json), all
# judged by detour's simulator, over seeds, under both queue policies.
#
#   benchmarks/planner/reference_example.sh [BUILD_DIR] [SEEDS] [CONTENTION]
#
# BUILD_DIR defaults to build, SEEDS to "0 1 2 3 4 5 6 7", CONTENTION to none
# (the reference's simulator has no link contention; "uplink" is detour's
# default). Prints a markdown table: pipeline seconds in arrival order /
# backward-first, planning time, and the ratio to the reference's paths.
set -euo pipefail
BUILD=${1:-build}
SEEDS=${2:-"0 1 2 3 4 5 6 7"}
CONTENTION=${3:-none}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SIM="$BUILD/tools/detour_sim/detour-sim"
[[ -x "$SIM" ]] || { echo "no $SIM; build the detour_sim_tool target first" >&2; exit 1; }
C="$ROOT/examples/clusters/skippipe_ref20.json"
J="$ROOT/examples/jobs/skippipe_ref20.json"
PIN="0,3,4,10,11;15,8,14;1,9,6;16,12,13;5,18,7;17,2,19"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

field() {  # field FILE KEY: a top-level number or the other policy's pipeline time
  python3 - "$1" "$2" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
k = sys.argv[2]
v = r["other_queue_policy"]["pipeline_time_s"] if k == "other" else r[k]
print(f"{v:.3f}")
PY
}

"$SIM" simulate --cluster "$C" --job "$J" --contention "$CONTENTION" \
  --routes "$ROOT/examples/routes/skippipe_ref20_ca.json" --json > "$TMP/ref.json"
REF_A=$(field "$TMP/ref.json" pipeline_time_s)
REF_B=$(field "$TMP/ref.json" other)
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg); contention: $CONTENTION"
echo
echo "| plan | objective | seed | pipeline s (arrival / backward-first) | vs reference | iteration s | plan s |"
echo "|---|---|---|---|---|---|---|"
echo "| reference: its partition + its CA paths | – | – | $REF_A / $REF_B | 1.000 / 1.000 | $(field "$TMP/ref.json" iteration_time_s) | – |"
for mode in pinned free free-iteration; do
  for seed in $SEEDS; do
    args=(--cluster "$C" --job "$J" --contention "$CONTENTION" --seed "$seed" --json)
    objective=pipeline
    case $mode in
      pinned) args+=(--assignment "$PIN" --objective pipeline) ;;
      free) args+=(--objective pipeline) ;;
      free-iteration) objective=iteration ;;
    esac
    "$SIM" plan "${args[@]}" > "$TMP/plan.json"
    A=$(field "$TMP/plan.json" pipeline_time_s)
    B=$(field "$TMP/plan.json" other)
    RA=$(python3 -c "print(f'{$A/$REF_A:.3f}')")
    RB=$(python3 -c "print(f'{$B/$REF_B:.3f}')")
    label="detour: reference partition pinned + its routes"
    [[ $mode != pinned ]] && label="detour: its assignment + its routes"
    echo "| $label | $objective | $seed | $A / $B | $RA / $RB | $(field "$TMP/plan.json" iteration_time_s) | $(field "$TMP/plan.json" planning_time_s) |"
  done
done
