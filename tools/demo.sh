#!/usr/bin/env bash
# The local demo: a coordinator and three workers on loopback, driven with
# detourctl, then the path scheduler on the shipped 20-node geo-distributed
# example (when detour-sim is built). Everything stops cleanly at the end and
# on Ctrl-C. Run it through `make demo`, or directly after a build:
#   DETOUR_BUILD_DIR=build tools/demo.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${DETOUR_BUILD_DIR:-$ROOT/build}
COORD=$BUILD/coordinator/detour-coordinator
WORKER=$BUILD/worker/detour-worker
CTL=$BUILD/tools/detourctl/detourctl
SIM=$BUILD/tools/detour_sim/detour-sim
WORKERS=${DEMO_WORKERS:-3}
OUT=${DEMO_OUT:-$ROOT/demo-out}

for bin in "$COORD" "$WORKER" "$CTL"; do
  [[ -x $bin ]] || { echo "demo: $bin is missing; run 'make build' first" >&2; exit 1; }
done

rm -rf "$OUT"
mkdir -p "$OUT"
PIDS=()
cleanup() {
  local code=$?
  if [[ ${#PIDS[@]} -gt 0 ]]; then
    echo "== stopping ${#PIDS[@]} daemons (SIGTERM)"
    kill -TERM "${PIDS[@]}" 2>/dev/null || true
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  fi
  exit $code
}
trap cleanup EXIT
trap 'echo; echo "demo: interrupted"; exit 130' INT TERM

wait_for() {  # file key
  for _ in $(seq 1 200); do
    if [[ -s $1 ]] && grep -q "\"$2\"" "$1"; then
      sed -E "s/.*\"$2\": \"?([^\",}]*)\"?.*/\1/" "$1"
      return 0
    fi
    sleep 0.05
  done
  echo "demo: timed out waiting for $1" >&2
  return 1
}

echo "== starting a coordinator on loopback (logs in $OUT/)"
"$COORD" --listen=127.0.0.1:0 --metrics_port=0 --metrics_bind=127.0.0.1 \
  --data_dir="$OUT/coordinator" --ready_file="$OUT/coordinator.ready" \
  --worker_silence=3s --heartbeat_interval=500ms 2>"$OUT/coordinator.log" &
PIDS+=($!)
GRPC_PORT=$(wait_for "$OUT/coordinator.ready" grpc_port)
METRICS_PORT=$(wait_for "$OUT/coordinator.ready" metrics_port)
export DETOUR_COORDINATOR=127.0.0.1:$GRPC_PORT
echo "   coordinator: gRPC 127.0.0.1:$GRPC_PORT, metrics http://127.0.0.1:$METRICS_PORT/metrics"

REGIONS=(Oregon Virginia Tokyo Frankfurt Sydney Seoul)
echo "== starting $WORKERS workers"
for i in $(seq 1 "$WORKERS"); do
  region=${REGIONS[$(( (i - 1) % ${#REGIONS[@]} ))]}
  "$WORKER" --listen=127.0.0.1:0 --metrics_port=0 --metrics_bind=127.0.0.1 \
    --coordinator="$DETOUR_COORDINATOR" --worker_id="demo-w$i" --region="$region" \
    --data_dir="$OUT/worker$i" --ready_file="$OUT/worker$i.ready" 2>"$OUT/worker$i.log" &
  PIDS+=($!)
done
for i in $(seq 1 "$WORKERS"); do wait_for "$OUT/worker$i.ready" worker_id >/dev/null; done
sleep 0.6  # a heartbeat or two

echo; echo "\$ detourctl workers"
"$CTL" workers
echo; echo "\$ detourctl health"
"$CTL" health
echo; echo "\$ detourctl submit examples/jobs/tiny_local.json"
"$CTL" submit "$ROOT/examples/jobs/tiny_local.json"
echo; echo "\$ detourctl list"
"$CTL" list
echo; echo "\$ curl -s http://127.0.0.1:$METRICS_PORT/metrics | grep ^detour_coordinator"
curl -s "http://127.0.0.1:$METRICS_PORT/metrics" | grep '^detour_coordinator' || true

if [[ -x $SIM ]]; then
  echo; echo "== path scheduler on the shipped 20-node, 11-region cluster (1.5B-shaped stages, 33% skip)"
  echo "\$ detour-sim compare --cluster examples/clusters/geo20.json --job examples/jobs/geo20_1.5b.json"
  "$SIM" compare --cluster "$ROOT/examples/clusters/geo20.json" \
    --job "$ROOT/examples/jobs/geo20_1.5b.json"
  for s in full skippipe; do
    "$SIM" plan --cluster "$ROOT/examples/clusters/geo20.json" \
      --job "$ROOT/examples/jobs/geo20_1.5b.json" --scheduler "$s" \
      --svg "$OUT/timeline_$s.svg" --trace "$OUT/trace_$s.json" >/dev/null
  done
  echo "   timelines: $OUT/timeline_full.svg and $OUT/timeline_skippipe.svg (open in a browser);"
  echo "   Chrome traces: $OUT/trace_*.json (open in https://ui.perfetto.dev)"
fi
echo
echo "Job execution (real training across the workers) arrives with the distributed"
echo "runtime; today the coordinator stores and lists submitted jobs."
