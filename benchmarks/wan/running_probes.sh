#!/usr/bin/env bash
# What the link probes cost while a job runs (docs/RUNTIME.md §"Measured
# links"): a latency round every --link_probe_interval, and one bulk slot
# every --link_probe_bulk_interval over the links the job's transfers do not
# measure.
#
# Two regions of two workers each with ONE_WAY_MS and RATE between them
# (within a region 1 ms and 50 MB/s), as benchmarks/wan/link_probe.sh;
# detour-local --wan runs the same job of ITERATIONS iterations with the
# running rounds off (both intervals 0) and on with both at INTERVAL (far
# shorter than the defaults of 60 s and 5 min, so that there are enough of
# them to measure), in the order off, on, on, off. Per run: the mean and
# median iteration time, the running bulk slots' measurements and how long
# the slots took; then the mean iteration's change (on against off, the two
# runs of each pooled), the job's time each bulk slot cost, and that cost
# at the default intervals (a latency round costs next to nothing: three
# 64-byte tensors per link). The forwarder's own ceiling is measured first
# (benchmarks/wan/ceiling.sh) and printed with the table.
#
#   sudo benchmarks/wan/running_probes.sh [--build DIR] [--interval 5s]
#       [--iterations 40] [--one_way_ms 50] [--rate 100]
# Needs root (the test bed). Prints the table with the load average before
# and after; the runs' logs stay in benchmarks-out/wan/running_probes_*.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$ROOT/build
interval=5s
iterations=40
ms=50
rate=100
die() { echo "running_probes: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=${2:?--build needs a directory}; shift 2 ;;
    --interval) interval=${2:?--interval needs a duration}; shift 2 ;;
    --iterations) iterations=${2:?--iterations needs a number}; shift 2 ;;
    --one_way_ms) ms=${2:?--one_way_ms needs a number}; shift 2 ;;
    --rate) rate=${2:?--rate needs MB/s}; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $iterations =~ ^[0-9]+$ ]] && ((iterations >= 5 && iterations <= 1000)) ||
  die "--iterations must be a whole number in [5, 1000]"
[[ $ms =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--one_way_ms must be a number"
[[ $rate =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--rate must be a number (MB/s)"
[[ $interval =~ ^[0-9]+(ms|s|m)$ ]] || die "--interval must be a duration such as 5s"
LOCAL=$BUILD/tools/detour_local/detour-local
[[ -x "$LOCAL" ]] || die "$LOCAL is not built"
[[ $(id -u) -eq 0 ]] || die "needs root for the test bed's namespaces"
OUT=$ROOT/benchmarks-out/wan
mkdir -p "$OUT"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# shellcheck source=benchmarks/wan/ceiling.sh
. "$ROOT/benchmarks/wan/ceiling.sh"
measure_ceiling "$ROOT" "$BUILD" "$OUT/running_probes_ceiling.txt"

# shellcheck source=benchmarks/wan/two_regions.sh
. "$ROOT/benchmarks/wan/two_regions.sh"
job=$OUT/running_probes_job.json
two_regions_job running-probes "$iterations" "$job"
cluster=$OUT/running_probes.cluster.json
two_regions_cluster running-probes "$ms" "$rate" "$cluster"

runs=()
k=0
for setting in 0 "$interval" "$interval" 0; do
  k=$((k + 1))
  run=$OUT/running_probes_$k
  rm -rf "$run"
  echo "== run $k: --link_probe_interval=$setting, $iterations iterations" >&2
  timeout -k 5 900 "$LOCAL" --wan --wan_prefix "rp$$" --cluster "$cluster" --job "$job" \
    --link_probe_interval="$setting" --link_probe_bulk_interval="$setting" \
    --out "$run" >"$run.out" 2>&1 ||
    { echo "running_probes: detour-local failed (see $run.out)" >&2; tail -20 "$run.out" >&2; exit 1; }
  runs+=("$setting:$run")
done

python3 - "$interval" "${runs[@]}" <<'PY'
import glob, re, statistics, sys
interval = sys.argv[1]
def seconds(d):
    m = re.fullmatch(r"([0-9]+)(ms|s|m)", d)
    return int(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60}[m.group(2)]
pooled = {"off": [], "on": []}
slots_on = 0
print(f"{'run':>3} {'interval':>8} {'iterations':>10} {'mean s':>7} {'median s':>8} "
      f"{'running bulk measurements':>25} {'slot s (max per round)':>22}")
for i, arg in enumerate(sys.argv[2:], 1):
    setting, run = arg.split(":", 1)
    times = [float(l.split(",")[2]) for l in open(run + "/loss.csv").read().split("\n")[1:] if l.strip()]
    times = times[1:]  # the first iteration opens the job's connections
    # The start: a latency round and the bulk slots (rounds 1-5 for four
    # workers); later rounds with per-link lines are running bulk slots.
    links, slot = 0, {}
    for log in glob.glob(run + "/w*.log"):
        pending = 0
        for line in open(log):
            if re.search(r": link to w\d+: round trip", line):
                pending += 1
            m = re.search(r"link probe round (\d+): \d+ peer\(s\) in ([0-9.]+) s", line)
            if m:
                r = int(m.group(1))
                if r > 5 and pending:
                    links += pending
                    slot[r] = max(slot.get(r, 0.0), float(m.group(2)))
                pending = 0
    key = "off" if setting == "0" else "on"
    pooled[key] += times
    if key == "on":
        slots_on += len(slot)
    slots = sorted(slot.values())
    print(f"{i:>3} {setting:>8} {len(times):>10} {statistics.mean(times):>7.3f} "
          f"{statistics.median(times):>8.3f} {links:>25} "
          f"{(f'{len(slots)} rounds, {min(slots):.1f}-{max(slots):.1f}' if slots else '-'):>22}")
off, on = statistics.mean(pooled["off"]), statistics.mean(pooled["on"])
change = on / off - 1
# The job's time the running rounds cost, per bulk slot (latency rounds
# included, they are next to nothing).
per_slot = (on - off) * len(pooled["on"]) / slots_on if slots_on else float("nan")
print(f"mean iteration: off {off:.3f} s, on (both every {interval}) {on:.3f} s: "
      f"{100 * change:+.1f} %; {slots_on} bulk slots, each costing the job {per_slot:.2f} s; "
      f"at the defaults (a bulk slot every 5 min): {100 * per_slot / 300:.2f} % of its time")
PY
echo "$CEILING_LINE (at the start)"
echo "load average before: $load_before, after: $(cut -d' ' -f1-3 /proc/loadavg)"
