#!/usr/bin/env bash
# K-FAC against AdamW in wall time, on real worker processes over an emulated
# geo cluster (the target: K-FAC reaches AdamW's final validation loss
# in <= 0.8x AdamW's wall time, on real text, two seeds).
#
# Setup (both optimisers, same seed, data and initial weights): tiny model
# (context 64), 2 stages, 2 data nodes and 2 replicas of stage 1 = 4 worker
# processes in Oregon, Virginia, Tokyo and Frankfurt (links of
# examples/clusters/geo12.json; frames delayed and rate-limited by
# --emulate_network), full routes, 4 microbatches per data node of 2 x 64
# tokens. Text: the first 4 MB of this machine's Debian copyright files
# (real English: licences and notices), prepared once with `detour-data
# prepare` (byte tokenizer, documents = paragraphs, 5% of them held out for
# validation). AdamW: lr 2e-3, 5 warm-up iterations, cosine decay over the
# job. K-FAC: the job defaults (replica_sync AUTO for the replicated stage:
# the coordinator picks FACTORS or PRECONDITIONED from the cost model and
# logs why, printed below; 1 curvature microbatch per node, grafted onto
# AdamW's step length, granules of <= 5 ms) and factor_decay 0.5.
#
# Each run writes a checkpoint every EVAL_EVERY iterations (all kept); then
# every checkpoint is evaluated on the validation split (detour-eval, nats
# per byte, at most MAX_SAMPLES samples spread over it). A checkpoint's wall
# time is when its iteration ended, counted from the start of training
# (detour-local's loss.csv: the first iteration's end minus its duration).
# Reported per seed: AdamW's final validation loss L and wall time T; the
# first K-FAC checkpoint whose validation loss is <= L, its wall time t
# (linearly interpolated between the two checkpoints around the crossing,
# and the checkpoint's own time as an upper bound) and t/T; the same for
# the training loss smoothed over 10 iterations. A markdown table at the
# end (also in OUT/table.md).
#
#   benchmarks/runtime/kfac_time_to_loss.sh [BUILD_DIR] [ITERATIONS] [SEEDS] [EVAL_EVERY] [MAX_SAMPLES]
# Defaults: build, 60 iterations, seeds "1 2", a checkpoint every 5
# iterations, 64 validation samples. Writes benchmarks-out/kfac_time/*.
# Runs one job at a time (4 workers + coordinator); note the machine's load.
# Cost (measured 2026-12-02 at 40 iterations on the 2-vCPU development VM,
# load 6-13): 189-264 s per AdamW run and 395-496 s per K-FAC run, with
# evaluation; about 25 min of wall time and at most 50 CPU-minutes for
# `build 40 "1 2" 5 64`. Time grows about linearly with ITERATIONS (the
# default 60: about 40 min there). Give it >= 5 cores (5 processes) so
# that bubbles are idle time; on fewer cores the wall-time ratio measures
# CPU contention, not K-FAC.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
ITERS=${2:-60}
SEEDS=${3:-1 2}
EVERY=${4:-5}
SAMPLES=${5:-64}
# KFAC_SYNC=FACTORS (or PRECONDITIONED) sets kfac.replica_sync instead of the
# job default (AUTO for replicated stages); its runs go to
# benchmarks-out/kfac_time-<scheme>.
KFAC_SYNC=${KFAC_SYNC:-}
case $KFAC_SYNC in
  "") OUT=$ROOT/benchmarks-out/kfac_time; SYNC_JSON="" ;;
  FACTORS|PRECONDITIONED)
    OUT=$ROOT/benchmarks-out/kfac_time-${KFAC_SYNC,,}
    SYNC_JSON=", \"replica_sync\": \"KFAC_REPLICA_SYNC_$KFAC_SYNC\"" ;;
  *) echo "KFAC_SYNC must be FACTORS or PRECONDITIONED, not '$KFAC_SYNC'" >&2; exit 2 ;;
esac
LOCAL=$BUILD/tools/detour_local/detour-local
EVAL=$BUILD/tools/detour_eval/detour-eval
DATA=$BUILD/tools/detour_data/detour-data
for b in "$LOCAL" "$EVAL" "$DATA"; do
  [ -x "$b" ] || { echo "missing $b: build the tree first (docs/DEVELOPMENT.md)" >&2; exit 2; }
done
mkdir -p "$OUT"

TEXT=$OUT/copyright.txt
if [ ! -s "$TEXT" ]; then
  find /usr/share/doc -name copyright -type f | LC_ALL=C sort | xargs cat 2>/dev/null |
    iconv -f utf-8 -t utf-8 -c | head -c 4000000 > "$TEXT" || true  # head closes the pipe
fi
SET=$OUT/dataset
if [ ! -s "$SET/manifest.json" ]; then
  "$DATA" prepare --output "$SET" --force --quiet --validation_fraction 0.05 "$TEXT"
fi

# Four workers (detour-local names them w1..w4 and gives them the cluster
# nodes' regions in order).
python3 - "$ROOT/examples/clusters/geo12.json" "$OUT/geo4.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
regions = ["Oregon", "Virginia", "Tokyo", "Frankfurt"]
d["name"] = "geo4"
d["nodes"] = [{"id": "w%d" % (i + 1), "region": r, "speed": 1.0} for i, r in enumerate(regions)]
d["links"] = [l for l in d["links"] if l["region_a"] in regions and l["region_b"] in regions]
json.dump(d, open(sys.argv[2], "w"), indent=1)
PY

job() {  # name seed optimizer-json
  cat > "$OUT/$1.json" <<JSON
{ "name": "$1", "model": { "preset": "tiny", "context_length": 64 },
  "pipeline": { "num_stages": 2, "data_nodes": 2, "replicas_per_stage": 2,
    "microbatches_per_data_node": 4, "samples_per_microbatch": 2, "skip_ratio": 0,
    "memory_slots": 4, "scheduler": "SCHEDULER_FULL" },
  "optimizer": $3,
  "data": { "source": "DATA_SOURCE_SHARDS", "path": "$SET" },
  "iterations": $ITERS,
  "checkpoint": { "every_iterations": $EVERY, "keep_last": $((ITERS / EVERY + 1)) },
  "seed": $2 }
JSON
}
ADAMW='"adamw": { "lr": 2e-3 }, "warmup_iterations": 5'
KFAC="\"kind\": \"OPTIMIZER_KFAC\", $ADAMW, \"kfac\": { \"factor_decay\": 0.5$SYNC_JSON }"

echo "load average at start: $(cat /proc/loadavg)"
for seed in $SEEDS; do
  for r in adamw kfac; do
    name=${r}_s$seed
    case $r in
      adamw) job "$name" "$seed" "{ $ADAMW }" ;;
      kfac) job "$name" "$seed" "{ $KFAC }" ;;
    esac
    dir=$OUT/run-$name
    start=$(date +%s)
    "$LOCAL" --job "$OUT/$name.json" --cluster "$OUT/geo4.json" --emulate_network \
      --insecure --out "$dir" > "$OUT/$name.log" 2>&1
    cp "$dir/loss.csv" "$OUT/$name.csv"
    # The replica sync scheme AUTO chose (the coordinator's reason).
    grep -o "K-FAC replica sync [A-Z]*:.*" "$dir/coordinator.log" | head -1 || true
    # Every kept checkpoint on the validation split: iteration,nll.
    : > "$OUT/$name.val"
    for ckpt in "$dir"/coordinator/checkpoints/*/iter-*; do
      [ -s "$ckpt/manifest.json" ] || continue
      it=$((10#$(basename "$ckpt" | sed 's/iter-//')))
      nll=$("$EVAL" --checkpoint "$ckpt" --max-samples "$SAMPLES" --json 2>/dev/null |
            python3 -c 'import json,sys; print("%.5f" % json.load(sys.stdin)["mean_nll"])')
      echo "$it,$nll" >> "$OUT/$name.val"
    done
    echo "$name: $(( $(date +%s) - start )) s (with evaluation), load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done

python3 - "$OUT" "$SEEDS" <<'PY' | tee "$OUT/table.md"
import csv, sys
out, seeds = sys.argv[1], sys.argv[2].split()

def run(name):
    rows = list(csv.reader(open(f"{out}/{name}.csv")))[1:]
    it = [int(r[0]) for r in rows]
    loss = [float(r[1]) for r in rows]
    wall = [float(r[9]) for r in rows]
    # Seconds since training began: the first iteration's end minus its duration.
    t0 = wall[0] - float(rows[0][2])
    wall = [w - t0 for w in wall]
    val = sorted(tuple(map(float, l.split(","))) for l in open(f"{out}/{name}.val") if l.strip())
    return it, loss, wall, val

def wall_at(it, wall, i):
    return wall[it.index(i)] if i in it else float("nan")

def smooth(loss, k=10):
    return [sum(loss[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(loss))]

def first_reach(points, target):
    """points: [(wall, value)] in time order -> (interpolated, upper bound) wall time."""
    for j, (t, v) in enumerate(points):
        if v <= target:
            if j == 0:
                return t, t
            t1, v1 = points[j - 1]
            frac = (v1 - target) / (v1 - v) if v1 != v else 1.0
            return t1 + frac * (t - t1), t
    return None, None

print("| seed | AdamW final val. loss | AdamW wall (s) | K-FAC final val. loss | K-FAC reaches it at (val.) | ratio | smoothed train loss: AdamW final → K-FAC reaches it at | ratio |")
print("|---|---|---|---|---|---|---|---|")
for s in seeds:
    ai, al, aw, av = run(f"adamw_s{s}")
    ki, kl, kw, kv = run(f"kfac_s{s}")
    target = av[-1][1]
    T = aw[-1]
    pts = [(wall_at(ki, kw, int(i)), v) for i, v in kv]
    t, ub = first_reach(pts, target)
    reach = f"{t:.0f} s (≤ {ub:.0f} s)" if t is not None else "not reached"
    ratio = f"{t / T:.2f}" if t is not None else "–"
    sa, sk = smooth(al), smooth(kl)
    ts, ubs = first_reach(list(zip(kw, sk)), sa[-1])
    sreach = f"{sa[-1]:.3f} → {ts:.0f} s" if ts is not None else f"{sa[-1]:.3f} → not reached"
    sratio = f"{ts / T:.2f}" if ts is not None else "–"
    print(f"| {s} | {target:.4f} (it {int(av[-1][0])}) | {T:.0f} | {kv[-1][1]:.4f} | {reach} | "
          f"{ratio} | {sreach} | {sratio} |")
print()
print("Validation loss (nats per byte) by iteration, wall seconds in brackets:")
for s in seeds:
    for r in ("adamw", "kfac"):
        i, l, w, v = run(f"{r}_s{s}")
        print(f"- {r} seed {s}: " + ", ".join(f"{int(it)}: {val:.3f} ({wall_at(i, w, int(it)):.0f})"
                                               for it, val in v))
PY
echo "load average at end: $(cat /proc/loadavg)"
