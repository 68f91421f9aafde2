#!/usr/bin/env bash
# K-FAC in the bubbles on real worker processes: the per-iteration cost of
# K-FAC with its work placed in the pipeline's idle gaps, against AdamW and
# against the same K-FAC work run serially at the end of each step
# (KfacSpec.placement = KFAC_PLACEMENT_SERIAL). Same job, data and seed.
#
# One worker per core (2 workers: stage 0 = data node, stage 1), one LibTorch
# thread each, so a worker's idle gap is really idle compute (with more
# workers than cores, one worker's bubble is another's compute time). Tiny
# model, full pipeline of 2 stages, 8 microbatches, curvature from every
# microbatch (K-FAC work comparable to the bubbles). Settings:
#   lan — loopback, no emulation: the bubbles are pipeline fill and drain;
#   wan — the two workers in Oregon and Tokyo (examples/clusters/geo12.json
#         links), frames delayed and rate-limited: the bubbles include the
#         network waits, the setting detour is built for.
# Mean iteration time over iterations 3.. (the first two warm up).
#
#   benchmarks/runtime/kfac_overhead.sh [BUILD_DIR] [ITERATIONS] [SETTINGS] [RUNS]
# SETTINGS: "lan wan" (default). RUNS (default "adamw kfac kfac_serial"), from:
#   adamw          AdamW
#   kfac           K-FAC in the bubbles, curvature from all 8 microbatches
#   kfac_serial    the same work serially at step end (refreshing every iteration)
#   kfac1          K-FAC in the bubbles, job defaults (1 curvature microbatch)
#   kfac1_serial3  that work serially, refreshing every 3 iterations
# Writes benchmarks-out/kfac/*.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
ITERS=${2:-12}
SETTINGS=${3:-lan wan}
RUNS=${4:-adamw kfac kfac_serial}
OUT=$ROOT/benchmarks-out/kfac
LOCAL=$BUILD/tools/detour_local/detour-local
mkdir -p "$OUT"

job() {  # name optimizer-json
  cat > "$OUT/$1.json" <<JSON
{ "name": "$1", "model": { "preset": "tiny" },
  "pipeline": { "num_stages": 2, "data_nodes": 1, "replicas_per_stage": 1,
    "microbatches_per_data_node": 8, "samples_per_microbatch": 4, "skip_ratio": 0,
    "memory_slots": 8, "scheduler": "SCHEDULER_FULL" },
  "optimizer": $2,
  "iterations": $ITERS, "checkpoint": { "disabled": true }, "seed": 5 }
JSON
}
KFAC='"kind": "OPTIMIZER_KFAC", "adamw": { "lr": 2e-3 }, "warmup_iterations": 2'
job adamw '{ "adamw": { "lr": 2e-3 }, "warmup_iterations": 2 }'
job kfac "{ $KFAC, \"kfac\": { \"curvature_microbatches\": 8, \"factor_decay\": 0.5 } }"
job kfac_serial "{ $KFAC, \"kfac\": { \"curvature_microbatches\": 8, \"factor_decay\": 0.5,
                   \"placement\": \"KFAC_PLACEMENT_SERIAL\" } }"
job kfac1 "{ $KFAC, \"kfac\": { \"factor_decay\": 0.5 } }"
job kfac1_serial3 "{ $KFAC, \"kfac\": { \"factor_decay\": 0.5, \"refresh_interval\": 3,
                     \"placement\": \"KFAC_PLACEMENT_SERIAL\" } }"

python3 - "$ROOT/examples/clusters/geo12.json" "$OUT/wan2.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d["name"] = "wan2"
d["nodes"] = [{"id": "w0", "region": "Oregon"}, {"id": "w1", "region": "Tokyo"}]
d["links"] = [l for l in d["links"] if {l["region_a"], l["region_b"]} == {"Oregon", "Tokyo"}]
json.dump(d, open(sys.argv[2], "w"), indent=1)
PY

# Mean of a loss.csv column over iterations 3...
mean_col() { awk -F, -v c="$2" 'NR>3 {s+=$c; n++} END {if (n) printf "%.4f", s/n; else print "nan"}' "$1"; }
last_col() { tail -1 "$1" | cut -d, -f"$2"; }
max_ms() { awk -F, -v c="$2" 'NR>1 && $c*1000>m {m=$c*1000} END {printf "%.1f", m}' "$1"; }

printf "%-6s %-14s %9s %7s %6s %10s %10s %10s %13s\n" setting optimizer iter_s ratio busy busy+kfac refreshes final_loss max_delay_ms
for setting in $SETTINGS; do
  extra=()
  [ "$setting" = wan ] && extra=(--cluster "$OUT/wan2.json" --emulate_network)
  base=""
  for j in $RUNS; do
    "$LOCAL" --job "$OUT/$j.json" --workers 2 "${extra[@]}" --out "$OUT/run-$setting-$j" >/dev/null
    csv="$OUT/run-$setting-$j/loss.csv"
    cp "$csv" "$OUT/${setting}_$j.csv"
    t=$(mean_col "$csv" 3)
    [ -z "$base" ] && base=$t
    printf "%-6s %-14s %9s %7s %6s %10s %10s %10s %13s\n" "$setting" "$j" "$t" \
      "$(awk -v a="$t" -v b="$base" 'BEGIN {printf "%.3f", a/b}')" \
      "$(mean_col "$csv" 7)" "$(mean_col "$csv" 8)" "$(last_col "$csv" 9)" "$(last_col "$csv" 2)" "$(max_ms "$csv" 11)"
  done
done
