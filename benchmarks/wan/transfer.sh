#!/usr/bin/env bash
# Tensor transfers over the direct transport against the link's ceiling, on
# the WAN test bed: two namespaces joined by detour-wanem, one link per case
# (round trip, rate, loss, jitter). Per case, in the same run:
#   - ceiling: iperf3 -P 16 (and one stream beside it);
#   - wan_transfer over plaintext and over TLS, 16 and 64 MiB tensors: what
#     opening the connections and a 64-byte tensor over them take (open), the
#     first tensor, isolated tensors (one at a time, after a pause) and a
#     stream of 4 tensors queued at once, --stream_runs times: the median run
#     and the slowest, then isolated tensors again on the windows the
#     streams opened (isolated warm; benchmarks/wan/wan_transfer.cc).
# Prints one table row per case and transport, and the load average.
# docs/BENCHMARKS.md §WAN "Transfers over long fat links". Needs root.
#
#   sudo benchmarks/wan/transfer.sh [--build DIR]
#       [--cases 'RTT_MS:MBPS:LOSS[:JITTER_MS[:reorder]] ...'] [--seconds N]
#       [--mib 16,64] [--stream_runs N] [--tune] [--initcwnd N] [--rtt_hint]
#       [--out DIR] [--send_args 'ARGS']
#
# A case's jitter adds a uniform draw in [0, JITTER_MS] to each packet's
# one-way delay on both directions; packets keep their order unless the case
# ends in :reorder (then a later packet may overtake an earlier one).
# --tune sets, inside the two namespaces only, the settings docs/OPERATIONS.md
# §"Tuning for long fat networks" recommends (tcp_wmem/tcp_rmem max,
# tcp_slow_start_after_idle=0); net.core.{w,r}mem_max are global and are
# reported, not changed. --initcwnd N sets, inside the two namespaces only,
# the window a new connection starts with, in packets, on every route
# (`ip route change ... initcwnd N initrwnd N`; Linux's default is 10; the
# same section). Rate 0 = no cap (the forwarder's own ceiling): the sender
# then has no rate hint, as a worker before its first probe. --send_args go
# to every `wan_transfer send` (e.g. '--connections 4'). --rtt_hint gives the
# sender each case's round trip too, as a worker's link probes do: its
# stripes then open at once instead of after the first connection's
# handshake.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
build="$root/build"
cases="20:100:0 100:100:0 300:100:0 20:0:0 100:0:0 300:0:0 100:100:0.01 100:100:0:10 100:100:0:10:reorder"
seconds=6
stream_runs=3
mib=16,64
tune=0
initcwnd=""
rtt_hint=0
out=""
send_args=""
prefix="wanxfer$$"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build=${2:?--build needs a directory}; shift 2 ;;
    --cases) cases=${2:?--cases needs a list}; shift 2 ;;
    --seconds) seconds=${2:?--seconds needs a number}; shift 2 ;;
    --mib) mib=${2:?--mib needs sizes}; shift 2 ;;
    --stream_runs) stream_runs=${2:?--stream_runs needs a number}; shift 2 ;;
    --tune) tune=1; shift ;;
    --rtt_hint) rtt_hint=1; shift ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --send_args) send_args=${2?--send_args needs arguments}; shift 2 ;;
    --initcwnd) initcwnd=${2:?--initcwnd needs a number of packets}; shift 2 ;;
    -h|--help) sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "transfer: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "transfer: $*" >&2; exit 1; }
[[ "$seconds" =~ ^[0-9]+$ ]] && (( seconds >= 2 && seconds <= 60 )) ||
  die "--seconds must be a whole number in [2, 60]"
[[ "$stream_runs" =~ ^[0-9]+$ ]] && (( stream_runs >= 1 && stream_runs <= 20 )) ||
  die "--stream_runs must be a whole number in [1, 20]"
[[ -z "$initcwnd" ]] || { [[ "$initcwnd" =~ ^[0-9]+$ ]] && (( initcwnd >= 1 && initcwnd <= 1024 )); } ||
  die "--initcwnd must be a whole number of packets in [1, 1024]"
for c in $cases; do
  [[ "$c" =~ ^[0-9]+:[0-9]+:(0|0?\.[0-9]+)(:(0|[1-9][0-9]*)(:reorder)?)?$ ]] ||
    die "--cases: '$c' is not RTT_MS:MBPS:LOSS[:JITTER_MS[:reorder]]"
done
tool="$build/benchmarks/wan/wan_transfer"
wanem="$build/tools/detour_wanem/detour-wanem"
[[ -x "$tool" ]] || die "$tool is missing: cmake --build $build --target wan_transfer"
[[ -x "$wanem" ]] || die "$wanem is missing: cmake --build $build --target detour-wanem"
command -v iperf3 >/dev/null || die "iperf3 is missing (tools/install_deps.sh)"
(( EUID == 0 )) || die "needs root (network namespaces, TUN devices)"

testbed="$root/tools/wan_testbed.sh"
work=$(mktemp -d)
[[ -n "$out" ]] || out="$work"
mkdir -p "$out"
cleanup() {
  "$testbed" down --prefix "$prefix" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
"$root/tools/gen_certs.sh" "$work/certs" --worker bench >/dev/null

cat >"$work/cluster.json" <<'JSON'
{"name": "transfer", "nodes": [{"id": "a", "region": "X"}, {"id": "b", "region": "Y"}],
 "links": [{"region_a": "X", "region_b": "Y", "latency_ms": 0, "bandwidth_gbytes_per_s": 1}]}
JSON

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
# 64k packets in flight: a 300 ms round trip at 100 MB/s holds ~20k data
# packets, plus the queue and the acknowledgements.
"$testbed" up --cluster "$work/cluster.json" --prefix "$prefix" --binary "$wanem" \
  -- --pool_packets 65536 >/dev/null
A="$prefix-a" B="$prefix-b"
if (( tune )); then
  for ns in "$A" "$B"; do
    ip netns exec "$ns" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0 \
      net.ipv4.tcp_wmem="4096 131072 67108864" net.ipv4.tcp_rmem="4096 131072 67108864"
  done
fi
if [[ -n "$initcwnd" ]]; then
  for ns in "$A" "$B"; do
    ip -n "$ns" -4 route show | while read -r route; do
      # shellcheck disable=SC2086  # the route's words are ip's arguments
      ip -n "$ns" route change $route initcwnd "$initcwnd" initrwnd "$initcwnd" ||
        die "could not set initcwnd on '$route' in $ns"
    done
  done
fi
routes=$(ip -n "$A" -4 route show | paste -sd ';' -)
sysctls=$(ip netns exec "$A" sh -c 'echo "wmem_max=$(cat /proc/sys/net/core/wmem_max) rmem_max=$(cat /proc/sys/net/core/rmem_max) tcp_wmem=\"$(cat /proc/sys/net/ipv4/tcp_wmem)\" tcp_rmem=\"$(cat /proc/sys/net/ipv4/tcp_rmem)\" slow_start_after_idle=$(cat /proc/sys/net/ipv4/tcp_slow_start_after_idle) cc=$(cat /proc/sys/net/ipv4/tcp_congestion_control)"' | tr '\t' ' ')

ip netns exec "$B" iperf3 -s -D -p 5201
ip netns exec "$B" "$tool" serve --listen 10.77.0.2:7700 >"$work/serve_plain.log" 2>&1 &
ip netns exec "$B" "$tool" serve --listen 10.77.0.2:7701 --certs "$work/certs" \
  >"$work/serve_tls.log" 2>&1 &
for i in $(seq 50); do
  ip netns exec "$B" ss -ltn | grep -q ':7701 ' &&
    ip netns exec "$B" ss -ltn | grep -q ':5201 ' && break
  sleep 0.1
done

# MB/s (1e6) the receiver saw, from iperf3's text summary; -O 2 leaves out
# the first two seconds (slow start over the long round trips). The client
# can fail (it did in 2 of 6 runs over a 300 ms link with 1 % loss; its
# error was not kept): up to 3 tries, then 0 and a warning. (A failed client
# must not end the script: under set -e a failed command substitution did,
# silently.)
iperf() {  # iperf STREAMS
  local v try
  for try in 1 2 3; do
    v=$(timeout $((seconds + 30)) ip netns exec "$A" iperf3 -c 10.77.0.2 -p 5201 -t "$seconds" \
          -O 2 -P "$1" -f m 2>/dev/null |
        awk '/receiver/ { for (i = 1; i < NF; i++) if ($(i + 1) == "Mbits/sec") v = $i }
             END { if (v == "") print "0"; else printf "%.1f", v / 8 }') || v=0
    [[ "$v" != 0 ]] && { echo "$v"; return 0; }
    sleep 1
  done
  echo "transfer: iperf3 -P $1 gave no result in 3 tries" >&2
  echo 0
}
field() { sed -n "s/.*\b$2=\([^ ]*\).*/\1/p" <<<"$1"; }

printf '%s\n' "case RTT rate loss [jitter]: transport, tensor, rates in MB/s (ratio to -P 16)"
printf '%-30s %-9s %5s %8s %8s %15s %15s %15s %15s %15s %11s %8s\n' case transport MiB "-P 16" \
  "1 stream" first isolated stream "stream worst" "isolated warm" connections "open ms"
for c in $cases; do
  IFS=: read -r rtt rate loss jitter order <<<"$c"
  jitter=${jitter:-0}
  reorder=0 label="$rtt ms $rate MB/s $loss"
  if (( jitter > 0 )); then label+=" +${jitter}ms"; fi
  if [[ "$order" == reorder ]]; then reorder=1 label+=" reorder"; fi
  half=$(awk -v r="$rtt" 'BEGIN { printf "%g", r / 2 }')
  "$testbed" ctl --prefix "$prefix" set a b both "delay_ms=$half" "rate_mbytes=$rate" \
    "loss=$loss" "jitter_ms=$jitter" "reorder=$reorder" >/dev/null
  p16=$(iperf 16)
  p1=$(iperf 1)
  hint=()
  (( rate > 0 )) && hint=(--rate_mbytes "$rate")
  (( rtt_hint )) && hint+=(--rtt_ms "$rtt")
  for mode in plain tls; do
    port=7700 certs=()
    [[ "$mode" == tls ]] && port=7701 certs=(--certs "$work/certs")
    log="$out/transfer_${rtt}_${rate}_${loss}_${jitter}_${reorder}_$mode.txt"
    if ! timeout 600 ip netns exec "$A" "$tool" send --to "10.77.0.2:$port" --mib "$mib" \
        --stream_runs "$stream_runs" "${certs[@]}" "${hint[@]}" $send_args >"$log" 2>"$log.err"; then
      echo "transfer: case $c $mode failed: $(tail -n 3 "$log.err")" >&2
      continue
    fi
    conn=$(field "$(grep '^rtt ' "$log")" connections)
    open=$(field "$(grep '^rtt ' "$log")" open_ms)
    while read -r line; do
      [[ "$line" == size* ]] || continue
      ratio() { awk -v v="$1" -v c="$p16" 'BEGIN { if (c > 0) printf "%.1f (%.2f)", v, v / c; else printf "%.1f", v }'; }
      printf '%-30s %-9s %5s %8s %8s %15s %15s %15s %15s %15s %11s %8s\n' "$label" "$mode" \
        "$(field "$line" mib)" "$p16" "$p1" "$(ratio "$(field "$line" first_mbps)")" \
        "$(ratio "$(field "$line" isolated_mbps)")" "$(ratio "$(field "$line" stream_mbps)")" \
        "$(ratio "$(field "$line" stream_worst_mbps)")" \
        "$(ratio "$(field "$line" isolated_warm_mbps)")" "$conn" "$open"
    done <"$log"
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
echo "namespace settings: $sysctls"
echo "routes in the sender's namespace: $routes"
echo "load average before: $load_before; after: $load_after; $(nproc) cores"
