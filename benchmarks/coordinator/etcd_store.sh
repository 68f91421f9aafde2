#!/usr/bin/env bash
# The job store on etcd (docs/BENCHMARKS.md §"The job store on etcd"), against
# a 3-member etcd cluster of its own on loopback (the Debian binary; $DETOUR_ETCD
# names another):
#   1. store writes per training iteration: a real coordinator on etcd, three
#      real workers and the e2e micro job (3 stages), ITERATIONS iterations and
#      twice as many (their difference: what one more iteration writes);
#      the coordinator's own count of etcd transactions
#      (detour_coordinator_store_request_seconds_count{op}) before and after,
#      and their time against the job's wall time;
#   2. etcd_store_bench with JOBS ended jobs: storing them, a new leader's
#      load, a coordinator's start-up on them, and List of all of them.
#
#   benchmarks/coordinator/etcd_store.sh [BUILD_DIR] [JOBS] [ITERATIONS]
# Prints the machine, the load average before and after, and each number.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
JOBS=${2:-10000}
ITERS=${3:-20}
ETCD=${DETOUR_ETCD:-$(command -v etcd || echo /usr/bin/etcd)}
[ -x "$ETCD" ] || { echo "no etcd binary (apt-get install etcd-server, or set DETOUR_ETCD)" >&2; exit 2; }
TMP=$(mktemp -d /tmp/detour-etcd-store.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT

free_ports() {  # N
  python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}
ready_field() {  # FILE KEY: waits up to 60 s for the daemon's ready file
  for _ in $(seq 600); do
    if [ -s "$1" ]; then
      python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2" \
        2>/dev/null && return 0
    fi
    sleep 0.1
  done
  echo "no $2 in $1" >&2
  return 1
}
metric() {  # PORT NAME{labels}: the value, 0 when absent
  python3 - "$1" "$2" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=10).read().decode()
for line in text.splitlines():
    if line.startswith(sys.argv[2] + " "):
        print(line.split()[-1]); break
else:
    print(0)
PY
}

read -r -a PORTS <<<"$(free_ports 6)"
CLUSTER="m0=http://127.0.0.1:${PORTS[3]},m1=http://127.0.0.1:${PORTS[4]},m2=http://127.0.0.1:${PORTS[5]}"
ENDPOINTS="127.0.0.1:${PORTS[0]},127.0.0.1:${PORTS[1]},127.0.0.1:${PORTS[2]}"
for i in 0 1 2; do
  c=${PORTS[$i]}; p=${PORTS[$((i + 3))]}
  "$ETCD" --name "m$i" --data-dir "$TMP/m$i" --listen-client-urls "http://127.0.0.1:$c" \
    --advertise-client-urls "http://127.0.0.1:$c" --listen-peer-urls "http://127.0.0.1:$p" \
    --initial-advertise-peer-urls "http://127.0.0.1:$p" --initial-cluster "$CLUSTER" \
    --initial-cluster-state new --initial-cluster-token detour-bench \
    --logger=zap --log-level=warn >"$TMP/m$i.log" 2>&1 &
  PIDS+=($!)
done
for _ in $(seq 300); do
  python3 -c 'import sys,urllib.request; sys.exit(0 if b"true" in urllib.request.urlopen("http://127.0.0.1:%s/health" % sys.argv[1], timeout=2).read() else 1)' \
    "${PORTS[0]}" 2>/dev/null && break
  sleep 0.2
done

echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); machine: $(nproc) cores, $(uname -m); $("$ETCD" --version | head -1)"
echo "etcd: 3 members on loopback ($ENDPOINTS)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

# --- 1. store writes per iteration ---------------------------------------------
"$BUILD/coordinator/detour-coordinator" --listen=127.0.0.1:0 --insecure --metrics_port=0 \
  --metrics_bind=127.0.0.1 --data_dir="$TMP/c" --ready_file="$TMP/c.ready" \
  --store="etcd://$ENDPOINTS" --store_prefix=/iterations/ >"$TMP/c.log" 2>&1 &
PIDS+=($!)
GRPC=$(ready_field "$TMP/c.ready" grpc_port)
METRICS=$(ready_field "$TMP/c.ready" metrics_port)
for i in 0 1 2; do
  "$BUILD/worker/detour-worker" --listen=127.0.0.1:0 --insecure --metrics_port=-1 \
    --coordinator="127.0.0.1:$GRPC" --data_dir="$TMP/w$i" --worker_id="w$i" --torch_threads=1 \
    --ready_file="$TMP/w$i.ready" >"$TMP/w$i.log" 2>&1 &
  PIDS+=($!)
done
for i in 0 1 2; do ready_field "$TMP/w$i.ready" grpc_port >/dev/null; done
job() {  # NAME ITERATIONS
  cat >"$TMP/$1.json" <<JSON
{ "name": "$1",
  "model": { "num_layers": 3, "d_model": 32, "num_heads": 2, "ffn_dim": 64, "context_length": 16 },
  "pipeline": { "num_stages": 3, "data_nodes": 1, "replicas_per_stage": 1,
    "microbatches_per_data_node": 2, "samples_per_microbatch": 2, "skip_ratio": 0,
    "scheduler": "SCHEDULER_FULL" },
  "optimizer": { "adamw": { "lr": 3e-3 } }, "iterations": $2, "seed": 11 }
JSON
}
W='detour_coordinator_store_request_seconds_count{op="write"}'
C='detour_coordinator_store_request_seconds_count{op="create"}'
S='detour_coordinator_store_request_seconds_sum{op="write"}'
# One job of ITERATIONS and one of twice as many: their difference is what
# each further iteration writes (submission and stage assignment cancel out).
RESULTS=()
for n in "$ITERS" "$((2 * ITERS))"; do
  job "writes-$n" "$n"
  w0=$(metric "$METRICS" "$W"); c0=$(metric "$METRICS" "$C"); s0=$(metric "$METRICS" "$S")
  t0=$(date +%s.%N)
  "$BUILD/tools/detourctl/detourctl" --insecure --coordinator="127.0.0.1:$GRPC" \
    submit "$TMP/writes-$n.json" --watch >"$TMP/watch-$n.log" 2>&1 ||
    { cat "$TMP/watch-$n.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  w1=$(metric "$METRICS" "$W"); c1=$(metric "$METRICS" "$C"); s1=$(metric "$METRICS" "$S")
  RESULTS+=("$n $w0 $w1 $c0 $c1 $s0 $s1 $t0 $t1")
done
python3 - "${RESULTS[@]}" <<'PY'
import sys
runs = []
for arg in sys.argv[1:]:
    it, w0, w1, c0, c1, s0, s1, t0, t1 = map(float, arg.split())
    writes, creates, secs, wall = w1 - w0, c1 - c0, s1 - s0, t1 - t0
    runs.append((it, writes, secs, wall))
    print("job of %d iterations: submit to SUCCEEDED %.2f s (%.3f s per iteration); etcd "
          "transactions %d create + %d record writes (%.2f per iteration), %.3f s in record "
          "writes (%.2f ms each, %.2f%% of the wall time)" %
          (it, wall, wall / it, creates, writes, writes / it, secs, 1000 * secs / max(writes, 1),
           100 * secs / wall))
(a, wa, sa, ta), (b, wb, sb, tb) = runs
print("each further iteration: %.2f record writes, %.2f ms of record writes per %.3f s "
      "iteration (%.2f%%)" % ((wb - wa) / (b - a), 1000 * (sb - sa) / (b - a), (tb - ta) / (b - a),
                               100 * (sb - sa) / max(tb - ta, 1e-9)))
PY

# --- 2. many jobs ----------------------------------------------------------------
"$BUILD/benchmarks/coordinator/etcd_store_bench" --etcd="$ENDPOINTS" \
  --coordinator_bin="$BUILD/coordinator/detour-coordinator" --jobs="$JOBS"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
