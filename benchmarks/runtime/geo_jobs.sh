#!/usr/bin/env bash
# Emulated geo-distributed training: 12 workers on this machine whose frames are
# delayed and rate-limited per examples/clusters/geo12.json (11 AWS regions), the
# tiny model in 6 stages (2 data nodes, 2 replicas of the 5 other stages), full
# pipeline vs 33% skip. Compares each measured iteration time with detour-sim's
# prediction for the same cluster and job, after calibrating the simulator's
# compute speed on the same workers without emulation.
#
#   benchmarks/runtime/geo_jobs.sh [BUILD_DIR] [ITERATIONS]
# Writes benchmarks-out/geo/*.csv and prints a summary table.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
ITERS=${2:-6}
OUT=$ROOT/benchmarks-out/geo
LOCAL=$BUILD/tools/detour_local/detour-local
SIM=$BUILD/tools/detour_sim/detour-sim
mkdir -p "$OUT"

job() {  # name scheduler skip
  cat > "$OUT/$1.json" <<JSON
{ "name": "$1", "model": { "preset": "tiny" },
  "pipeline": { "num_stages": 6, "data_nodes": 2, "replicas_per_stage": 2,
    "microbatches_per_data_node": 6, "samples_per_microbatch": 2, "skip_ratio": $3,
    "max_jump": 3, "max_swaps": 0, "memory_slots": 3, "scheduler": "$2" },
  "optimizer": { "adamw": { "lr": 1e-3 } },
  "iterations": $ITERS, "checkpoint": { "disabled": true }, "seed": 3 }
JSON
}
job full SCHEDULER_FULL 0
job skip SCHEDULER_SKIPPIPE 0.33

# Mean of a CSV column over iterations 2.. (the first includes warm-up).
mean_col() { awk -F, -v c="$2" 'NR>2 {s+=$c; n++} END {if (n) printf "%.3f", s/n; else print "nan"}' "$1"; }
sim_time() {  # cluster job tflops
  "$SIM" plan --cluster "$1" --job "$2" --tflops "$3" --json |
    sed -n 's/.*"iteration_time_s": \([0-9.e+-]*\).*/\1/p' | head -1
}

# 1. Calibrate: the same 12 workers in one region, no emulation, full pipeline.
python3 - "$ROOT/examples/clusters/geo12.json" "$OUT/local12.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
json.dump({"name": "local12", "nodes": [{"id": n["id"], "region": "local"} for n in d["nodes"]],
           "intra_region_latency_ms": 0.2, "intra_region_bandwidth_gbytes_per_s": 2.0},
          open(sys.argv[2], "w"), indent=1)
PY
echo "== calibration run (no emulation)"
"$LOCAL" --job "$OUT/full.json" --workers 12 --cluster "$OUT/local12.json" --out "$OUT/run-local" >/dev/null
cp "$OUT/run-local/loss.csv" "$OUT/local_full.csv"
measured_local=$(mean_col "$OUT/local_full.csv" 3)
# Bisect the speed-1.0 TFLOP/s that makes the simulator match.
lo=0.00001; hi=10
for _ in $(seq 1 40); do
  mid=$(awk -v a="$lo" -v b="$hi" 'BEGIN {printf "%.8f", sqrt(a*b)}')
  t=$(sim_time "$OUT/local12.json" "$OUT/full.json" "$mid")
  if awk -v t="$t" -v m="$measured_local" 'BEGIN {exit !(t > m)}'; then lo=$mid; else hi=$mid; fi
done
TFLOPS=$mid
echo "   measured ${measured_local}s per iteration -> calibrated compute: ${TFLOPS} TFLOP/s per worker"

# 2. The emulated geo-distributed runs.
for j in full skip; do
  echo "== $j on the emulated 11-region network"
  "$LOCAL" --job "$OUT/$j.json" --workers 12 --cluster "$ROOT/examples/clusters/geo12.json" \
    --emulate_network --out "$OUT/run-$j" >/dev/null
  cp "$OUT/run-$j/loss.csv" "$OUT/geo_$j.csv"
done
full_m=$(mean_col "$OUT/geo_full.csv" 3)
skip_m=$(mean_col "$OUT/geo_skip.csv" 3)
full_s=$(sim_time "$ROOT/examples/clusters/geo12.json" "$OUT/full.json" "$TFLOPS")
skip_s=$(sim_time "$ROOT/examples/clusters/geo12.json" "$OUT/skip.json" "$TFLOPS")
echo
printf "%-22s %12s %12s %10s\n" "run" "measured_s" "simulated_s" "sim/meas"
for r in "full $full_m $full_s" "skip(33%) $skip_m $skip_s"; do
  set -- $r
  printf "%-22s %12s %12s %10s\n" "$1" "$2" "$3" "$(awk -v a="$3" -v b="$2" 'BEGIN {printf "%.2f", a/b}')"
done
echo "skip/full measured: $(awk -v a="$skip_m" -v b="$full_m" 'BEGIN {printf "%.2f", a/b}')," \
     "simulated: $(awk -v a="$skip_s" -v b="$full_s" 'BEGIN {printf "%.2f", a/b}')"
for j in full skip; do
  o=$(mean_col "$OUT/geo_$j.csv" 6)
  m=$(mean_col "$OUT/geo_$j.csv" 3)
  echo "coordinator overhead ($j): ${o}s per iteration = $(awk -v a="$o" -v b="$m" 'BEGIN {printf "%.2f%%", 100*a/b}') of the iteration"
done
