#!/usr/bin/env bash
# How well the workers' link probes (docs/RUNTIME.md §"Measured links")
# measure the links of the packet-level WAN test bed, and what they cost.
#
# For each case, two regions of two workers each (like
# examples/clusters/wan2.json) with the case's one-way latency and rate
# between the regions (within a region: 1 ms and 50 MB/s), detour-local --wan
# runs a short job; before its first plan every worker probes every other.
# The workers' logs give each link's probed round trip and rate; the script
# compares them with the emulated values (round trip = twice the one-way
# latency) and reports, per case, the worst ratio of each, the start round's
# time, the median iteration time, and what a latency round while the job
# runs costs against an iteration. The forwarder's own ceiling is measured
# first (benchmarks/wan/ceiling.sh) and printed with the table.
#
#   sudo benchmarks/wan/link_probe.sh [BUILD_DIR]
# Needs root (the test bed). Writes benchmarks-out/wan/link_probe.csv and
# prints a table with the load average before and after.
#
# LINK_PROBE_CASES replaces the cases ("name one_way_ms rate_mbytes_per_s",
# several separated by ";"), e.g. LINK_PROBE_CASES="far-300ms 300 67";
# LINK_PROBE_BIN_DIR runs the daemons from another folder (detour-local's
# --bin_dir: a copy of an older build's detour-worker beside this build's
# other binaries), for a before-and-after in one sitting.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
OUT=$ROOT/benchmarks-out/wan
LOCAL=$BUILD/tools/detour_local/detour-local
[[ -x "$LOCAL" ]] || { echo "$0: $LOCAL is not built" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || { echo "$0: needs root for the test bed's namespaces" >&2; exit 1; }
mkdir -p "$OUT"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# shellcheck source=benchmarks/wan/ceiling.sh
. "$ROOT/benchmarks/wan/ceiling.sh"
measure_ceiling "$ROOT" "$BUILD" "$OUT/link_probe_ceiling.txt"

# name one_way_ms rate_mbytes_per_s
CASES=(
  "lan-10ms 10 100"
  "wan-50ms 50 100"
  "far-150ms 150 50"
)
if [[ -n "${LINK_PROBE_CASES:-}" ]]; then
  IFS=';' read -r -a CASES <<<"$LINK_PROBE_CASES"
fi
BIN_ARGS=()
if [[ -n "${LINK_PROBE_BIN_DIR:-}" ]]; then
  [[ -d "$LINK_PROBE_BIN_DIR" ]] || { echo "$0: LINK_PROBE_BIN_DIR $LINK_PROBE_BIN_DIR is not a folder" >&2; exit 1; }
  BIN_ARGS=(--bin_dir "$LINK_PROBE_BIN_DIR")
fi

# shellcheck source=benchmarks/wan/two_regions.sh
. "$ROOT/benchmarks/wan/two_regions.sh"
two_regions_job link-probe 6 "$OUT/link_probe_job.json"

csv=$OUT/link_probe.csv
echo "case,from,to,emulated_rtt_ms,probed_rtt_ms,rtt_ratio,emulated_mbytes_per_s,probed_mbytes_per_s,rate_ratio,probe_mib,stream_between_acks_ratio,stream_whole_ratio,before_stream_ratio" >"$csv"
summary=()
for c in "${CASES[@]}"; do
  read -r name ms rate <<<"$c"
  cluster=$OUT/link_probe_$name.cluster.json
  two_regions_cluster "$name" "$ms" "$rate" "$cluster"
  run=$OUT/link_probe_$name
  rm -rf "$run"
  echo "== $name: $ms ms one way, $rate MB/s between the regions" >&2
  timeout -k 5 300 "$LOCAL" --wan --wan_prefix "lp$$" --cluster "$cluster" \
    --job "$OUT/link_probe_job.json" --out "$run" "${BIN_ARGS[@]}" >"$run.out" 2>&1 ||
    { echo "$0: detour-local failed for $name (see $run.out)" >&2; cat "$run.out" >&2; exit 1; }
  # Workers w1, w2 are East (e0, e1); w3, w4 West (the launcher's order).
  python3 - "$name" "$ms" "$rate" "$run" "$csv" <<'PY' >>"$OUT/link_probe_summary.txt"
import csv, glob, re, statistics, sys
name, ms, rate, run, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
region = {"w1": "East", "w2": "East", "w3": "West", "w4": "West"}
rows, rounds, streams = [], {}, {}
for log in sorted(glob.glob(run + "/w*.log")):
    me = log.rsplit("/", 1)[1][:-4]
    for line in open(log):
        # The stream's rate both ways (between its first and last
        # acknowledgement, the estimate used; over the whole stream less a
        # round trip, the one used before) and the best before it.
        m = re.search(r"probe stream to (w\d+): .* ([0-9.]+) MB/s between its first and last ack, "
                      r"([0-9.]+) MB/s over the whole stream; ([0-9.]+) MB/s before it", line)
        if m:
            streams[(me, m.group(1))] = [float(m.group(i)) for i in (2, 3, 4)]
        m = re.search(r"link to (w\d+): round trip ([0-9.]+) ms, ([0-9.]+) MB/s \(([0-9.]+) MiB", line)
        if m:
            peer = m.group(1)
            cross = region[me] != region[peer]
            e_rtt = 2 * (ms if cross else 1.0)
            e_rate = rate if cross else 50.0
            rtt, r = float(m.group(2)), float(m.group(3))
            st = streams.get((me, peer), [float("nan")] * 3)
            rows.append([name, me, peer, e_rtt, rtt, rtt / e_rtt, e_rate, r, r / e_rate, float(m.group(4)),
                         st[0] / e_rate, st[1] / e_rate, st[2] / e_rate])
        # The start: round 1 (latency), then round 2 (bulk).
        m = re.search(r"link probe round ([12]): \d+ peer\(s\) in ([0-9.]+) s", line)
        if m:
            rounds[m.group(1)] = max(rounds.get(m.group(1), 0.0), float(m.group(2)))
start_s = sum(rounds.values())
with open(out, "a", newline="") as f:
    csv.writer(f).writerows([[f"{x:.4g}" if isinstance(x, float) else x for x in r] for r in rows])
times = []
for line in open(run + "/loss.csv").read().split("\n")[1:]:
    if line.strip():
        times.append(float(line.split(",")[2]))
it = statistics.median(times[1:]) if len(times) > 1 else float("nan")
links = len(rows)
# A latency round: 3 pings of 64 bytes per link (plus frame headers), every 60 s.
ping_bytes_per_s = links * 3 * 64 / 60.0
worst_rtt = max(abs(r[5] - 1) for r in rows) if rows else float("nan")
worst_rate = max(abs(r[8] - 1) for r in rows) if rows else float("nan")
def spread(values):
    values = [v for v in values if v == v]
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"
cross = [r for r in rows if r[3] > 2.5]
within = lambda rs, col: sum(1 for r in rs if r[col] == r[col] and abs(r[col] - 1) <= 0.15)
# What the whole-stream estimate would have given: the best of it and what came before.
old_best = [max(r[11], r[12]) for r in cross]
print(f"{name:10s} links {links:2d}  rtt error max {100*worst_rtt:5.1f}%  "
      f"rate error max {100*worst_rate:5.1f}%  start round {start_s:5.2f} s  "
      f"iteration {it:6.3f} s  latency round {ping_bytes_per_s:.1f} B/s")
print(f"{'':10s} cross-region rate ratio {spread([r[8] for r in cross])} "
      f"({within(cross, 8)} of {len(cross)} within 15 %); stream between acks "
      f"{spread([r[10] for r in cross])}, whole stream {spread([r[11] for r in cross])}, "
      f"best with the whole-stream rate {spread(old_best)} "
      f"({sum(1 for v in old_best if abs(v - 1) <= 0.15)} of {len(cross)} within 15 %)")
PY
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo
cat "$OUT/link_probe_summary.txt"
rm -f "$OUT/link_probe_summary.txt"
echo "per link: $csv"
echo "$CEILING_LINE (at the start)"
echo "load average before: $load_before, after: $load_after"
