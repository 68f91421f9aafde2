#!/usr/bin/env bash
# Elastic churn over the packet-level WAN test bed: a job runs on five
# workers in two regions (detour-local --wan), or with --geo12 on twelve, one
# per node of examples/clusters/geo12.json (the tiny model in 6 stages, 2
# replicas each, the links scaled under the forwarder's measured ceiling as
# benchmarks/wan/geo12_testbed.sh does), and while it runs the script
#   1. cuts the link between two live workers of neighbouring stages (both
#      ways), the pair whose link carries the most, for --cut_s seconds,
#      then restores it;
#   2. gives every link 1% random loss for --loss_s seconds, then none;
#   3. kills a worker of the last stage (SIGKILL), leaving its replica and
#      the spare.
# It reports the job's end state, the iterations and their mean time in each
# phase (from loss.csv), and what the coordinator made of each fault: the
# job's events (links cut and restored, workers lost and joined, microbatches
# re-planned or dropped). The claim checked: a cut link between two live
# workers evicts neither of them. The cut lasts longer (40 s) than detecting
# it takes (about 26 s, docs/RUNTIME.md §"Link faults and partitions"). The
# forwarder's own ceiling is measured first (benchmarks/wan/ceiling.sh) and
# printed with the rest.
# docs/BENCHMARKS.md §WAN "Churn over the test bed". Needs root.
#
#   sudo benchmarks/wan/churn.sh [--build DIR] [--iterations N] [--cut_s S]
#       [--loss_s S] [--one_way_ms MS] [--rate_mbytes R] [--out DIR]
#   sudo benchmarks/wan/churn.sh --geo12 [--build DIR] [--iterations N]
#       [--cut_s S] [--loss_s S] [--out DIR]
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
build="$root/build"
iterations=
geo12=0
cut_s=40
loss_s=20
one_way_ms=50
rate=50
out=
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=${2:?--build needs a directory}; shift 2 ;;
    --iterations) iterations=${2:?}; shift 2 ;;
    --cut_s) cut_s=${2:?}; shift 2 ;;
    --loss_s) loss_s=${2:?}; shift 2 ;;
    --one_way_ms) one_way_ms=${2:?}; shift 2 ;;
    --rate_mbytes) rate=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --geo12) geo12=1; shift ;;
    -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "churn: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "churn: $*" >&2; exit 1; }
# geo12's iterations take about three times the two regions' (12 workers on
# the same cores), so fewer of them span the phases.
if (( geo12 )); then
  iterations=${iterations:-60}
  out=${out:-$root/benchmarks-out/wan/churn-geo12}
else
  iterations=${iterations:-100}
  out=${out:-$root/benchmarks-out/wan/churn}
fi
for v in iterations cut_s loss_s one_way_ms rate; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "--$v must be a whole number"
done
(( iterations >= 10 && iterations <= 1000 )) || die "--iterations must be in [10, 1000]"
(( cut_s <= 600 && loss_s <= 600 )) || die "--cut_s and --loss_s must be at most 600"
(( EUID == 0 )) || die "needs root (network namespaces, TUN devices)"
local_bin="$build/tools/detour_local/detour-local"
[[ -x "$local_bin" ]] || die "$local_bin is not built"
testbed="$root/tools/wan_testbed.sh"
export DETOUR_WANEM="$build/tools/detour_wanem/detour-wanem"

mkdir -p "$out"
rm -rf "$out/run"
prefix="churn$$"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
# shellcheck source=benchmarks/wan/ceiling.sh
. "$root/benchmarks/wan/ceiling.sh"
measure_ceiling "$root" "$build" "$out/ceiling.txt"
wan_args=()
if (( geo12 )); then
  workers=12
  cp "$root/examples/clusters/geo12.json" "$out/cluster.json"
  # As geo12_testbed.sh: the fastest region link under the measured ceiling.
  scale=$(scale_under_ceiling "$out/cluster.json" "$CEILING_GBYTES")
  wan_args=(--wan_bandwidth_scale "$scale")
  echo "churn: geo12, bandwidth scale $scale" >&2
  stages=6
  microbatches=6
  slots=3
else
  workers=5
  gb=$(awk -v r="$rate" 'BEGIN { print r / 1000 }')
  cat >"$out/cluster.json" <<JSON
{ "name": "churn",
  "nodes": [ { "id": "n1", "region": "East" }, { "id": "n2", "region": "East" },
             { "id": "n3", "region": "West" }, { "id": "n4", "region": "West" },
             { "id": "n5", "region": "West" } ],
  "links": [ { "region_a": "East", "region_b": "West", "latency_ms": $one_way_ms,
               "bandwidth_gbytes_per_s": $gb } ],
  "intra_region_latency_ms": 1.0, "intra_region_bandwidth_gbytes_per_s": 0.05 }
JSON
  stages=2
  microbatches=2
  slots=2
fi
cat >"$out/job.json" <<JSON
{ "name": "churn", "model": { "preset": "tiny" },
  "pipeline": { "num_stages": $stages, "data_nodes": 2, "replicas_per_stage": 2,
    "microbatches_per_data_node": $microbatches, "samples_per_microbatch": 2,
    "memory_slots": $slots },
  "optimizer": { "adamw": { "lr": 1e-3 } },
  "data": { "source": "DATA_SOURCE_EMBEDDED" },
  "iterations": $iterations, "checkpoint": { "every_iterations": 10 }, "seed": 5,
  "device": "cpu" }
JSON

"$local_bin" --wan --wan_prefix "$prefix" --cluster "$out/cluster.json" --job "$out/job.json" \
  --workers "$workers" ${wan_args[@]+"${wan_args[@]}"} --out "$out/run" >"$out/run.out" 2>&1 &
local_pid=$!
cleanup() {
  kill -INT "$local_pid" 2>/dev/null || true
  wait "$local_pid" 2>/dev/null || true
}
trap cleanup EXIT

now() { date +%s.%N; }
# The iteration detour-local's progress line last showed.
iteration() { { grep -o "iteration [0-9]*/" "$out/run.out" 2>/dev/null || true; } | tail -n 1 | tr -dc 0-9; }
wait_iteration() {  # wait_iteration N TIMEOUT_S
  local deadline=$((SECONDS + $2)) i
  while (( SECONDS < deadline )); do
    kill -0 "$local_pid" 2>/dev/null || die "detour-local ended early (see $out/run.out)"
    i=$(iteration)
    [[ -n "$i" ]] && (( i >= $1 )) && return 0
    sleep 1
  done
  die "no iteration $1 within $2 s (see $out/run.out)"
}
ctl() { "$testbed" ctl --prefix "$prefix" "$@" >/dev/null; }

phases=()
mark() { phases+=("$1 $(now)"); echo "churn: $1 at iteration $(iteration)" >&2; }

wait_iteration 3 600
mark baseline
sleep 15
# The cut: two workers of neighbouring stages (replicas of one stage must
# reach each other for their all-reduce: a cut between them leaves one out,
# by design; docs/RUNTIME.md §"Link faults and partitions"), the pair whose
# link carried the most over the last 10 s by the forwarder's counters: a
# pair the plan does not use costs nothing to cut (an earlier version cut a
# cross-region pair, which the plan left unused: each stage-0 worker sent to
# the stage-1 worker of its own region). Which node each worker runs on:
# detour-local's table ("node region address namespace worker wN").
awk 'NF == 6 && $5 == "worker" && $3 ~ /^[0-9.]+$/ { print $6, $1 }' "$out/run.out" >"$out/nodes.txt"
[[ -s "$out/nodes.txt" ]] || die "no worker-to-node table in $out/run.out"
link_bytes() {  # "from to bytes" per ordered pair of nodes, delivered so far
  "$testbed" ctl --prefix "$prefix" stats |
    awk '{ for (i = 3; i <= NF; i++) if ($i ~ /^delivered_bytes=/) { sub(/.*=/, "", $i); print $1, $2, $i } }'
}
link_bytes >"$out/bytes_before.txt"
sleep 10
link_bytes >"$out/bytes_after.txt"
pair=$(python3 - "$out/run/coordinator/jobs" "$out/bytes_before.txt" "$out/bytes_after.txt" \
  "$out/nodes.txt" <<'PY'
import glob, json, sys
job = json.load(open(sorted(glob.glob(sys.argv[1] + "/*.json"))[0]))
stages = [s.get("nodes", []) for s in job.get("stages", [])]
node = dict(line.split() for line in open(sys.argv[4]) if len(line.split()) == 2)
def load(path):
    out = {}
    for line in open(path):
        f = line.split()
        if len(f) == 3:
            out[(f[0], f[1])] = int(f[2])
    return out
before, after = load(sys.argv[2]), load(sys.argv[3])
def carried(a, b):
    return sum(after.get(k, 0) - before.get(k, 0) for k in [(a, b), (b, a)])
best = None
for k in range(len(stages) - 1):
    for a in stages[k]:
        for b in stages[k + 1]:
            if a not in node or b not in node:
                continue
            na, nb = node[a], node[b]
            if best is None or carried(na, nb) > best[2]:
                best = (na, nb, carried(na, nb))
if best is None:
    sys.exit(1)
print(best[0], best[1], best[2])
PY
) || die "no pair of workers of different stages: $(cat "$out"/run/coordinator/jobs/*.json | head -c 300)"
read -r cut_a cut_b cut_bytes <<<"$pair"
echo "churn: $cut_a <-> $cut_b carried $cut_bytes bytes in the last 10 s" >&2
mark "cut"
echo "churn: cutting $cut_a <-> $cut_b" >&2
ctl cut "$cut_a" "$cut_b" both
sleep "$cut_s"
ctl restore "$cut_a" "$cut_b" both
mark restored
sleep 15
mark loss
ctl set '*' '*' both loss=0.01
sleep "$loss_s"
ctl set '*' '*' both loss=0
mark no-loss
sleep 15
kill -0 "$local_pid" 2>/dev/null || die "the job ended before the kill: raise --iterations"
# The kill: a worker of the last stage outside the cut pair.
victim=$(python3 - "$out/run/coordinator/jobs" "$out/nodes.txt" "$cut_a" "$cut_b" <<'PY'
import glob, json, sys
job = json.load(open(sorted(glob.glob(sys.argv[1] + "/*.json"))[0]))
node = dict(line.split() for line in open(sys.argv[2]) if len(line.split()) == 2)
spared = set(sys.argv[3:])
for w in job["stages"][-1].get("nodes", []):
    if w in node and node[w] not in spared:
        print(node[w])
        break
PY
)
[[ -n "$victim" ]] || die "no worker to kill outside the cut pair"
mark kill
echo "churn: killing the worker on $victim" >&2
ip netns pids "$prefix-$victim" | xargs -r kill -KILL
if ! timeout 1800 tail --pid="$local_pid" -f /dev/null; then die "the job did not end within 30 min"; fi
trap - EXIT
wait "$local_pid" && rc=0 || rc=$?
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

printf '%s\n' "${phases[@]}" >"$out/phases.txt"
python3 - "$out" "$rc" <<'PY'
import csv, datetime, re, sys
out, rc = sys.argv[1], int(sys.argv[2])
log = open(out + "/run/coordinator.log").read().splitlines()
def ts(line):
    return datetime.datetime.strptime(line[:23], "%Y-%m-%dT%H:%M:%S.%f").replace(
        tzinfo=datetime.timezone.utc).timestamp()
submitted = next(ts(l) for l in log if " submitted" in l)
phases = [(p.split()[0], float(p.split()[1])) for p in open(out + "/phases.txt")]
rows = list(csv.DictReader(open(out + "/run/loss.csv")))
by_phase = {}
for r in rows:
    end = submitted + float(r["elapsed_s"])
    name = "start"
    for p, t in phases:
        if end >= t:
            name = p
    by_phase.setdefault(name, []).append(float(r["iteration_time_s"]))
print("phase       iterations  mean iteration (s)  max (s)")
for p in ["start"] + [p for p, _ in phases]:
    v = by_phase.get(p, [])
    if v:
        print(f"{p:<11} {len(v):>10}  {sum(v) / len(v):>18.2f}  {max(v):>7.2f}")
import glob, json
job = json.load(open(sorted(glob.glob(out + "/run/coordinator/jobs/*.json"))[0]))
events = [e for e in job.get("history", []) if e.get("kind") != "KIND_CHECKPOINT"]
counts = {}
for e in events:
    counts[e["kind"]] = counts.get(e["kind"], 0) + 1
print()
print("events:", ", ".join(f"{k[5:]} {v}" for k, v in sorted(counts.items())))
for e in events:
    print(f"  {e.get('iteration', '-'):>4} {e['kind'][5:]:<22} {e.get('message', '')[:110]}")
final = [l for l in log if "JOB_STATE_" in l]
print()
print("end:", final[-1][24:] if final else "no end state logged", f"(detour-local exit {rc})")
PY
echo "$CEILING_LINE (at the start)"
echo "load average before: $load_before; after: $load_after; $(nproc) cores"
