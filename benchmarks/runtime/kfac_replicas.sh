#!/usr/bin/env bash
# K-FAC with replicated stages on real worker processes and real text: how the
# replica synchronisation scheme (KfacSpec.replica_sync, docs/KFAC.md
# "Replicas") changes convergence, against AdamW. Same job, data and seed.
#
# Tiny model, 2 stages, 2 data nodes and 2 replicas of stage 1 (4 workers),
# full routes, 4 microbatches per data node of 2 × 64 bytes; the text is the
# Debian copyright files of this machine (real English, licences and notices;
# byte tokenizer), the first 4 MB of them in path order. Runs:
#   adamw           AdamW
#   factors         K-FAC, fp32 factors all-reduced among the replicas (exact)
#   preconditioned  K-FAC, each replica preconditions its own gradient (default)
# Reported: training loss (same batches in every run) averaged over
# iterations 1-10, 21-30 ... and the final validation loss (detour-eval on
# the last checkpoint, at most 64 validation samples, nats per byte).
#
#   benchmarks/runtime/kfac_replicas.sh [BUILD_DIR] [ITERATIONS] [SEEDS] [RUNS]
# Writes benchmarks-out/kfac_replicas/*.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
ITERS=${2:-60}
SEEDS=${3:-1 2}
RUNS=${4:-adamw factors preconditioned}
OUT=$ROOT/benchmarks-out/kfac_replicas
LOCAL=$BUILD/tools/detour_local/detour-local
EVAL=$BUILD/tools/detour_eval/detour-eval
mkdir -p "$OUT"

TEXT=$OUT/copyright.txt
if [ ! -s "$TEXT" ]; then
  find /usr/share/doc -name copyright -type f | LC_ALL=C sort | xargs cat 2>/dev/null |
    iconv -f utf-8 -t utf-8 -c | head -c 4000000 > "$TEXT" || true  # head closes the pipe
fi

job() {  # name seed optimizer-json
  cat > "$OUT/$1.json" <<JSON
{ "name": "$1", "model": { "preset": "tiny", "context_length": 64 },
  "pipeline": { "num_stages": 2, "data_nodes": 2, "replicas_per_stage": 2,
    "microbatches_per_data_node": 4, "samples_per_microbatch": 2, "skip_ratio": 0,
    "memory_slots": 4, "scheduler": "SCHEDULER_FULL" },
  "optimizer": $3,
  "data": { "source": "DATA_SOURCE_TEXT", "path": "$TEXT" },
  "iterations": $ITERS, "checkpoint": { "every_iterations": $ITERS }, "seed": $2 }
JSON
}
ADAMW='"adamw": { "lr": 2e-3 }, "warmup_iterations": 5'
KFAC="\"kind\": \"OPTIMIZER_KFAC\", $ADAMW"

printf "%-5s %-15s %8s %8s %8s %8s %8s %9s\n" seed run "1-10" "21-30" "41-50" last10 val_loss iter_s
for seed in $SEEDS; do
  for r in $RUNS; do
    name=${r}_s$seed
    case $r in
      adamw) job "$name" "$seed" "{ $ADAMW }" ;;
      factors) job "$name" "$seed" "{ $KFAC, \"kfac\": { \"factor_decay\": 0.5, \"replica_sync\": \"KFAC_REPLICA_SYNC_FACTORS\" } }" ;;
      preconditioned) job "$name" "$seed" "{ $KFAC, \"kfac\": { \"factor_decay\": 0.5, \"replica_sync\": \"KFAC_REPLICA_SYNC_PRECONDITIONED\" } }" ;;
      *) echo "unknown run $r" >&2; exit 2 ;;
    esac
    dir=$OUT/run-$name
    "$LOCAL" --job "$OUT/$name.json" --insecure --out "$dir" > "$OUT/$name.log" 2>&1
    csv=$dir/loss.csv
    cp "$csv" "$OUT/$name.csv"
    avg() { awk -F, -v a="$1" -v b="$2" 'NR>1 && $1>=a && $1<=b {s+=$2; n++} END {if (n) printf "%.4f", s/n; else printf "-"}' "$csv"; }
    last=$(awk -F, 'NR>1 {it=$1} END {print it}' "$csv")
    ckpt=$(awk '/^checkpoint: / {print $2}' "$OUT/$name.log" | tail -1)
    val=-
    if [ -n "$ckpt" ]; then
      val=$("$EVAL" --checkpoint "$ckpt" --max-samples 64 --json 2>/dev/null |
            python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.4f" % d["mean_nll"])' || echo -)
    fi
    its=$(awk -F, 'NR>3 {s+=$3; n++} END {if (n) printf "%.3f", s/n}' "$csv")
    printf "%-5s %-15s %8s %8s %8s %8s %8s %9s\n" "$seed" "$r" "$(avg 0 9)" "$(avg 20 29)" \
      "$(avg 40 49)" "$(avg $((last - 9)) "$last")" "$val" "$its"
  done
done
