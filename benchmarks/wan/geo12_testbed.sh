#!/usr/bin/env bash
# Geo-distributed training over the packet-level WAN test bed against the
# in-process emulation and the simulator, in one run: 12 workers, one per node
# of examples/clusters/geo12.json (11 AWS regions), the tiny model in 6 stages,
# full pipeline vs 33% skip.
#
#   1. calibration: the same 12 workers and full job on loopback, no emulation;
#      detour-sim's --tflops is bisected until its full-pipeline iteration
#      matches (this folds the CPU contention of 12 processes on few cores into
#      one per-worker speed), as benchmarks/runtime/geo_jobs.sh does;
#   2. full and skip with detour-local --wan: each worker in its own network
#      namespace, the kernel's TCP over detour-wanem's delays and rates;
#   3. full and skip with detour-local --emulate_network on loopback (the
#      workers delay their own frames);
#   4. detour-sim's prediction for each, at the calibrated speed, on the spec
#      each run's network had (the bed's with its bandwidth scale), and for the
#      bed's runs also on the link matrix the job's first plan was made on
#      (measured by the start's link probes: detour-local's links.json turned
#      into a spec by links_to_cluster.py).
#
#   sudo benchmarks/wan/geo12_testbed.sh [BUILD_DIR] [ITERATIONS] [SCALE]
# Needs root (the test bed). Writes benchmarks-out/wan/*.csv and prints a
# summary table with the load average before and after.
#
# Bandwidth scale: the run first measures the forwarder's own ceiling
# (benchmarks/wan/ceiling.sh: iperf3 through detour-wanem, no delay, no cap;
# the lower of its 8- and 16-stream figures). geo12's fastest link is
# 1.16 GB/s (9.3 Gbit/s), so the links are scaled until that one fits under
# the measured ceiling, and no further: scale = ceiling / 1.16, rounded down
# to two digits (0.15 at 1.4 Gbit/s, 0.26 at 2.5). SCALE, when given,
# overrides it (to repeat an earlier run's). The tiny model's transfers are
# far below that rate, so the scale barely changes the run; it keeps the
# forwarder from being the bottleneck the spec does not have, for one link
# at a time: twelve probe streams at once share it (the start's bulk slots).
# Only the region links set it: geo12's one intra-region pair (w0 and w11,
# Oregon, 5 GB/s) would demand five times less; it is left above what the
# forwarder carries, so on that pair the forwarder, not the spec, is the
# limit: still above every scaled WAN link.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
ITERS=${2:-6}
SCALE_ARG=${3:-}
OUT=$ROOT/benchmarks-out/wan
LOCAL=$BUILD/tools/detour_local/detour-local
SIM=$BUILD/tools/detour_sim/detour-sim
CLUSTER=$ROOT/examples/clusters/geo12.json

for b in "$LOCAL" "$SIM" "$BUILD/tools/detour_wanem/detour-wanem"; do
  [[ -x "$b" ]] || { echo "$0: $b is not built" >&2; exit 1; }
done
[[ $(id -u) -eq 0 ]] || { echo "$0: needs root for the test bed's namespaces" >&2; exit 1; }
[[ "$ITERS" =~ ^[0-9]+$ && "$ITERS" -ge 3 && "$ITERS" -le 50 ]] ||
  { echo "$0: ITERATIONS must be 3..50" >&2; exit 2; }
[[ -z "$SCALE_ARG" || "$SCALE_ARG" =~ ^(0\.[0-9]*[1-9][0-9]*|1(\.0*)?)$ ]] ||
  { echo "$0: SCALE must be in (0, 1]" >&2; exit 2; }
mkdir -p "$OUT"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date +%s)

job() {  # name scheduler skip
  cat >"$OUT/$1.json" <<JSON
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
# Median of a CSV column over iterations 2.. : the coordinator re-plans with
# measured speeds every 5 iterations, and an iteration after a new plan can be
# an outlier that a mean of five hides nothing of.
median_col() {
  awk -F, -v c="$2" 'NR>2 {print $c}' "$1" | sort -g |
    awk '{v[NR]=$1} END {if (!NR) print "nan"; else if (NR%2) printf "%.3f", v[(NR+1)/2];
         else printf "%.3f", (v[NR/2]+v[NR/2+1])/2}'
}
sim_time() {  # cluster job tflops
  "$SIM" plan --cluster "$1" --job "$2" --tflops "$3" --json |
    sed -n 's/.*"iteration_time_s": \([0-9.e+-]*\).*/\1/p' | head -1
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (b > 0) printf "%.2f", a/b; else print "nan"}'; }

# shellcheck source=benchmarks/wan/ceiling.sh
. "$ROOT/benchmarks/wan/ceiling.sh"
measure_ceiling "$ROOT" "$BUILD" "$OUT/geo12_ceiling.txt"
SCALE=${SCALE_ARG:-$(scale_under_ceiling "$CLUSTER" "$CEILING_GBYTES")}
# The spec the bed's links ran (what detour-local --wan also gives the planner).
python3 - "$CLUSTER" "$SCALE" "$OUT/geo12_scaled.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); s = float(sys.argv[2])
for l in d["links"]: l["bandwidth_gbytes_per_s"] *= s
d["intra_region_bandwidth_gbytes_per_s"] = d.get("intra_region_bandwidth_gbytes_per_s", 5.0) * s
json.dump(d, open(sys.argv[3], "w"), indent=1)
PY
if [[ -n "$SCALE_ARG" ]]; then
  echo "bandwidth scale for the test bed: $SCALE (given; the measured ceiling allows ${CEILING_GBYTES} GB/s)"
else
  echo "bandwidth scale for the test bed: $SCALE (fastest region link under the measured ${CEILING_GBYTES} GB/s)"
fi

# 1. Calibration.
python3 - "$CLUSTER" "$OUT/local12.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
json.dump({"name": "local12", "nodes": [{"id": n["id"], "region": "local"} for n in d["nodes"]],
           "intra_region_latency_ms": 0.2, "intra_region_bandwidth_gbytes_per_s": 2.0},
          open(sys.argv[2], "w"), indent=1)
PY
echo "== calibration run (loopback, no emulation)"
"$LOCAL" --job "$OUT/full.json" --workers 12 --cluster "$OUT/local12.json" \
  --out "$OUT/run-local" >"$OUT/run-local.txt"
cp "$OUT/run-local/loss.csv" "$OUT/local_full.csv"
measured_local=$(mean_col "$OUT/local_full.csv" 3)
lo=0.00001
hi=10
for _ in $(seq 1 40); do
  mid=$(awk -v a="$lo" -v b="$hi" 'BEGIN {printf "%.8f", sqrt(a*b)}')
  t=$(sim_time "$OUT/local12.json" "$OUT/full.json" "$mid")
  if awk -v t="$t" -v m="$measured_local" 'BEGIN {exit !(t > m)}'; then lo=$mid; else hi=$mid; fi
done
TFLOPS=$mid
echo "   ${measured_local}s per iteration -> ${TFLOPS} TFLOP/s per worker"

# 2. and 3. The four geo runs.
for j in full skip; do
  echo "== $j over the WAN test bed (--wan, bandwidth x $SCALE)"
  "$LOCAL" --job "$OUT/$j.json" --workers 12 --cluster "$CLUSTER" --wan \
    --wan_bandwidth_scale "$SCALE" --wan_prefix "geo12b$$" --out "$OUT/run-wan-$j" \
    >"$OUT/run-wan-$j.txt"
  cp "$OUT/run-wan-$j/loss.csv" "$OUT/wan_$j.csv"
  cp "$OUT/run-wan-$j/wan/stats.txt" "$OUT/wan_${j}_links.txt"
  cp "$OUT/run-wan-$j/links.json" "$OUT/wan_${j}_matrix.json"
  python3 "$ROOT/benchmarks/wan/links_to_cluster.py" "$CLUSTER" "$OUT/wan_${j}_matrix.json" \
    "$OUT/geo12_measured_$j.json"
  echo "== $j on loopback with --emulate_network"
  "$LOCAL" --job "$OUT/$j.json" --workers 12 --cluster "$CLUSTER" --emulate_network \
    --out "$OUT/run-emu-$j" >"$OUT/run-emu-$j.txt"
  cp "$OUT/run-emu-$j/loss.csv" "$OUT/emu_$j.csv"
done

load_after=$(cut -d' ' -f1-3 /proc/loadavg)
declare -A m md p s
for j in full skip; do
  for net in wan emu; do
    m[$net-$j]=$(mean_col "$OUT/${net}_$j.csv" 3)
    md[$net-$j]=$(median_col "$OUT/${net}_$j.csv" 3)
    p[$net-$j]=$(mean_col "$OUT/${net}_$j.csv" 5)
  done
  s[wan-$j]=$(sim_time "$OUT/geo12_scaled.json" "$OUT/$j.json" "$TFLOPS")
  s[emu-$j]=$(sim_time "$CLUSTER" "$OUT/$j.json" "$TFLOPS")
  s[meas-$j]=$(sim_time "$OUT/geo12_measured_$j.json" "$OUT/$j.json" "$TFLOPS")
done
echo
echo "geo12, tiny model, 6 stages, $ITERS iterations (means over 2..$ITERS), $(nproc) cores;" \
  "calibrated ${TFLOPS} TFLOP/s per worker; test bed bandwidth x $SCALE"
echo "$CEILING_LINE (at the start; $OUT/geo12_ceiling.txt)"
printf "%-12s %8s %8s %8s %9s %9s %8s %8s\n" run mean_s median_s sim_s sim/mean \
  sim/median pred_s wan/emu
for j in full skip; do
  for net in wan emu; do
    printf "%-12s %8s %8s %8.3f %9s %9s %8s %8s\n" "$j, $net" "${m[$net-$j]}" "${md[$net-$j]}" \
      "${s[$net-$j]}" "$(ratio "${s[$net-$j]}" "${m[$net-$j]}")" \
      "$(ratio "${s[$net-$j]}" "${md[$net-$j]}")" "${p[$net-$j]}" \
      "$([[ $net == wan ]] && ratio "${m[wan-$j]}" "${m[emu-$j]}" || echo -)"
  done
done
for j in full skip; do
  printf "%-12s %8s %8s %8.3f %9s %9s   (detour-sim on the measured link matrix)\n" \
    "$j, wan" "${m[wan-$j]}" "${md[wan-$j]}" "${s[meas-$j]}" \
    "$(ratio "${s[meas-$j]}" "${m[wan-$j]}")" "$(ratio "${s[meas-$j]}" "${md[wan-$j]}")"
done
echo "(pred_s: the coordinator's predicted_iteration_time_s, mean; wan/emu: of the means)"
echo "skip/full of the means: test bed $(ratio "${m[wan-skip]}" "${m[wan-full]}")," \
  "emulation $(ratio "${m[emu-skip]}" "${m[emu-full]}")," \
  "simulated (bed spec) $(ratio "${s[wan-skip]}" "${s[wan-full]}")," \
  "simulated (spec) $(ratio "${s[emu-skip]}" "${s[emu-full]}")," \
  "simulated (measured matrix) $(ratio "${s[meas-skip]}" "${s[meas-full]}")"
echo "skip/full of the medians: test bed $(ratio "${md[wan-skip]}" "${md[wan-full]}")," \
  "emulation $(ratio "${md[emu-skip]}" "${md[emu-full]}")"
echo "load average before: $load_before; after: $load_after; $(($(date +%s) - start)) s in all"
