#!/usr/bin/env bash
# The demo behind `make demo`:
#  1. real training on this machine: a coordinator and 8 workers on loopback
#     train the `tiny` model on the embedded corpus — 4 stages (2 data nodes,
#     2 replicas of each other stage), 25% skip (every microbatch visits 3 of
#     the 4 stages) — with a live progress line; it leaves the loss curve and
#     a checkpoint in demo-out/;
#  2. the path scheduler on the shipped 20-node, 11-region cluster: every
#     scheduler side by side, and timeline SVGs of `full` and `skippipe`.
# Everything stops cleanly at the end and on Ctrl-C.
# The daemons talk mutual TLS with a throwaway CA (demo-out/certs);
# DEMO_INSECURE=1 runs them plaintext instead.
#   DETOUR_BUILD_DIR=build tools/demo.sh      (after a build; `make demo` does both)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${DETOUR_BUILD_DIR:-$ROOT/build}
OUT=${DEMO_OUT:-$ROOT/demo-out}
LOCAL=$BUILD/tools/detour_local/detour-local
SIM=$BUILD/tools/detour_sim/detour-sim
for bin in "$LOCAL" "$SIM" "$BUILD/coordinator/detour-coordinator" "$BUILD/worker/detour-worker"; do
  [[ -x $bin ]] || { echo "demo: $bin is missing; run 'make build' first" >&2; exit 1; }
done

echo "== 1. training the tiny model across 8 local workers (examples/jobs/tiny_local.json)"
"$LOCAL" --job "$ROOT/examples/jobs/tiny_local.json" --out "$OUT" --bin_dir "$BUILD" \
  ${DEMO_ITERATIONS:+--iterations "$DEMO_ITERATIONS"} ${DEMO_INSECURE:+--insecure}

echo
echo "== 2. the path scheduler on 20 nodes over 11 regions (1.5B-shaped stages, 33% skip)"
echo "\$ detour-sim compare --cluster examples/clusters/geo20.json --job examples/jobs/geo20_1.5b.json"
"$SIM" compare --cluster "$ROOT/examples/clusters/geo20.json" \
  --job "$ROOT/examples/jobs/geo20_1.5b.json"
for s in full skippipe; do
  "$SIM" plan --cluster "$ROOT/examples/clusters/geo20.json" \
    --job "$ROOT/examples/jobs/geo20_1.5b.json" --scheduler "$s" \
    --svg "$OUT/timeline_$s.svg" --trace "$OUT/trace_$s.json" >/dev/null
done
echo
echo "Files in $OUT/:"
echo "  loss.csv, loss.svg            the training loss curve"
echo "  coordinator/checkpoints/      the checkpoint (manifest.json + one file per stage)"
echo "  timeline_{full,skippipe}.svg  per-node timelines: the bubbles shrink with skippipe"
echo "  trace_*.json                  the same as Chrome traces (open in ui.perfetto.dev)"
echo "  certs/                        the throwaway CA, certificates and token of this run"
echo "  *.log                         the daemons' logs"
