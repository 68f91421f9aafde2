#!/usr/bin/env bash
# Runs every Google Benchmark program under the build tree's benchmarks/ and
# prints where the JSON results went. Results to quote go to docs/BENCHMARKS.md
# with the command and the machine.
#   tools/run_benchmarks.sh [BUILD_DIR] [extra benchmark flags]
set -euo pipefail
BUILD=${1:-build}
shift || true
OUT=${BENCH_OUT:-$BUILD/bench-results}
mkdir -p "$OUT"
found=0
while IFS= read -r -d '' bin; do
  found=1
  name=$(basename "$bin")
  echo "== $name"
  "$bin" --benchmark_out="$OUT/$name.json" --benchmark_out_format=json "$@"
done < <(find "$BUILD/benchmarks" -type f -perm -u+x -name '*_bench*' -print0 2>/dev/null | sort -z)
if [[ $found -eq 0 ]]; then
  echo "no benchmark programs under $BUILD/benchmarks (configure with -DDETOUR_BUILD_BENCHMARKS=ON)" >&2
  exit 1
fi
echo "results: $OUT/"
