#!/usr/bin/env bash
# The WAN test bed's own ceiling: iperf3 between two namespaces through
# detour-wanem with no delay and no rate limit, with 1, 8 and 16 TCP streams,
# and the same over a direct veth pair as the reference. Prints a table and
# the load average (docs/BENCHMARKS.md §WAN). Needs root.
#
#   tools/wan_ceiling.sh [--binary PATH] [--seconds N] [--prefix NAME] [--wanem_only]
#
# --wanem_only leaves out the veth reference: the WAN benchmarks measure the
# forwarder's ceiling this way at the start of their own runs
# (benchmarks/wan/ceiling.sh).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
seconds=5
prefix="wanceil$$"
binary_args=()
wanem_only=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --binary) binary_args=(--binary "${2:?--binary needs a path}"); shift 2 ;;
    --seconds) seconds=${2:?--seconds needs a number}; shift 2 ;;
    --prefix) prefix=${2:?--prefix needs a name}; shift 2 ;;
    --wanem_only) wanem_only=1; shift ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "wan_ceiling: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || (( seconds < 1 || seconds > 60 )); then
  echo "wan_ceiling: --seconds must be a whole number in [1, 60]" >&2
  exit 2
fi
command -v iperf3 >/dev/null || { echo "wan_ceiling: iperf3 is missing (tools/install_deps.sh)" >&2; exit 1; }

testbed="$root/tools/wan_testbed.sh"
work=$(mktemp -d)
va="$prefix-va" vb="$prefix-vb"
veth_made=0
cleanup() {
  "$testbed" down --prefix "$prefix" >/dev/null 2>&1 || true
  if (( veth_made )); then
    ip netns pids "$vb" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns delete "$va" 2>/dev/null || true
    ip netns delete "$vb" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

cat >"$work/cluster.json" <<'JSON'
{"name": "ceiling", "nodes": [{"id": "a", "region": "X"}, {"id": "b", "region": "Y"}],
 "links": [{"region_a": "X", "region_b": "Y", "latency_ms": 0, "bandwidth_gbytes_per_s": 1}]}
JSON

# Mbit/s that the receiver saw, from iperf3's text summary.
measure() {  # measure NETNS SERVER_ADDRESS STREAMS
  timeout $((seconds + 20)) ip netns exec "$1" iperf3 -c "$2" -p 5201 -t "$seconds" -P "$3" -f m |
    awk '/receiver/ { for (i = 1; i < NF; i++) if ($(i + 1) == "Mbits/sec") v = $i } END { print v }'
}

wait_listening() {  # wait_listening NETNS
  local i
  for ((i = 0; i < 50; i++)); do
    ip netns exec "$1" ss -ltn | grep -q ':5201 ' && return 0
    sleep 0.1
  done
  echo "wan_ceiling: iperf3 server in $1 did not listen within 5 s" >&2
  return 1
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
"$testbed" up --cluster "$work/cluster.json" --prefix "$prefix" \
  --set 'a b both delay_ms=0 rate_mbytes=0' ${binary_args[@]+"${binary_args[@]}"} >/dev/null
ip netns exec "$prefix-b" iperf3 -s -D -p 5201
wait_listening "$prefix-b"

declare -A result
for p in 1 8 16; do result[wanem,$p]=$(measure "$prefix-a" 10.77.0.2 "$p"); done
"$testbed" down --prefix "$prefix" >/dev/null

report() {  # the table (the veth row when it was measured) and the load
  printf '%-28s %8s %8s %8s\n' "path (Mbit/s, ${seconds} s each)" "1 stream" "-P 8" "-P 16"
  printf '%-28s %8s %8s %8s\n' "detour-wanem (0 ms, no cap)" "${result[wanem,1]}" "${result[wanem,8]}" "${result[wanem,16]}"
  if [[ -n "${result[veth,1]:-}" ]]; then
    printf '%-28s %8s %8s %8s\n' "veth pair (reference)" "${result[veth,1]}" "${result[veth,8]}" "${result[veth,16]}"
  fi
  echo "load average before: $load_before; after: $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores"
}
if (( wanem_only )); then
  report
  exit 0
fi

ip netns add "$va"
veth_made=1
ip netns add "$vb"
ip link add wcv0 netns "$va" type veth peer name wcv1 netns "$vb"
ip -n "$va" addr add 10.78.0.1/24 dev wcv0
ip -n "$vb" addr add 10.78.0.2/24 dev wcv1
for ns in "$va" "$vb"; do ip -n "$ns" link set lo up; done
ip -n "$va" link set wcv0 up
ip -n "$vb" link set wcv1 up
ip netns exec "$vb" iperf3 -s -D -p 5201
wait_listening "$vb"
for p in 1 8 16; do result[veth,$p]=$(measure "$va" 10.78.0.2 "$p"); done
report
