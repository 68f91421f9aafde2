#!/usr/bin/env bash
# The activation transport against raw TCP on loopback, all paths in one run:
# raw TCP, the ActivationService stream (plaintext and TLS) and the direct
# transport (plaintext and TLS), 1 to 64 MiB, medians of REPS repetitions,
# and raw TCP with AES-128-GCM records (BM_RawTcpAesGcm: the cipher's work on
# both ends and nothing else, the bound for any TLS path); then OpenSSL's
# AES-GCM speed on one core. TLS paths are also given as a fraction of that
# bound.
# Prints the load average before and after and a markdown table of GB/s and
# ratios to raw TCP.
#
#   benchmarks/transport/compare.sh [BUILD_DIR] [REPS] [MIN_TIME_S]
set -euo pipefail
BUILD=${1:-build}
REPS=${2:-3}
MIN_TIME=${3:-1}
BENCH="$BUILD/benchmarks/transport/transport_bench"
[[ -x "$BENCH" ]] || { echo "no $BENCH; build the transport_bench target" >&2; exit 1; }
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores; $(uname -r)"
"$BENCH" --benchmark_min_time="$MIN_TIME" --benchmark_repetitions="$REPS" \
  --benchmark_report_aggregates_only=true --benchmark_format=json \
  --benchmark_filter='BM_(RawTcp|RawTcpAesGcm|Detour|DetourTls|DetourDirect|DetourDirectTls)/(1048576|4194304|16777216|67108864)/' \
  > "$OUT" 2> /dev/null
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
for cipher in aes-128-gcm aes-256-gcm; do
  printf '%s: ' "$cipher"
  openssl speed -elapsed -seconds 2 -bytes 16384 -evp "$cipher" 2>/dev/null | tail -1 |
    awk '{printf "%.2f GB/s (16 KiB records, one core)\n", $NF / 1e6}'
done
python3 - "$OUT" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))["benchmarks"]
rate = {}
medians = any(b.get("aggregate_name") == "median" for b in runs)
for b in runs:
    if medians and b.get("aggregate_name") != "median":
        continue
    name, size = b["run_name"].split("/")[:2]
    rate[(name, int(size))] = b["bytes_per_second"] / 2**30
paths = [("BM_Detour", "gRPC stream"), ("BM_DetourTls", "gRPC stream, TLS"),
         ("BM_DetourDirect", "direct"), ("BM_DetourDirectTls", "direct, TLS")]
print()
print("| tensor | raw TCP GB/s | raw TCP + AES-GCM GB/s (× raw) | "
      + " | ".join(f"{label} GB/s (× raw)" for _, label in paths) + " |")
print("|---|---|---|" + "---|" * len(paths))
for size in sorted({s for _, s in rate}):
    raw = rate.get(("BM_RawTcp", size))
    bound = rate.get(("BM_RawTcpAesGcm", size))
    def cell(r):
        return "–" if r is None or raw is None else f"{r:.2f} ({r / raw:.2f})"
    cells = [cell(bound)]
    for key, label in paths:
        r = rate.get((key, size))
        c = cell(r)
        if "TLS" in label and r is not None and bound:
            c += f", {r / bound:.2f} of bound"
        cells.append(c)
    print(f"| {size >> 20} MiB | {raw:.2f} | " + " | ".join(cells) + " |")
PY
