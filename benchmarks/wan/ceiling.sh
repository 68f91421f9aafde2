# shellcheck shell=bash
# The forwarder's own ceiling, measured at the start of the WAN benchmark
# that sources this (not run): a figure over the test bed means nothing above
# what detour-wanem itself carries on this machine at this load, so each run
# measures it beside its own figures (tools/wan_ceiling.sh --wanem_only:
# iperf3 through the forwarder with no delay and no cap, 1, 8 and 16 streams).
#
# measure_ceiling ROOT BUILD FILE: writes the table to FILE, prints one line,
# and sets CEILING_MBIT_1, CEILING_MBIT_8 and CEILING_MBIT_16 (Mbit/s) and
# CEILING_GBYTES (the lower of the 8- and 16-stream figures, in GB/s: what
# several links at once can carry) and CEILING_LINE (the line printed, for
# the benchmark's summary). Fails with a message when iperf3 or the
# measurement does.
measure_ceiling() {
  local root=$1 build=$2 file=$3 row
  if ! "$root/tools/wan_ceiling.sh" --wanem_only --seconds 3 \
      --binary "$build/tools/detour_wanem/detour-wanem" --prefix "ceil$$" >"$file" 2>&1; then
    echo "measure_ceiling: tools/wan_ceiling.sh failed:" >&2
    cat "$file" >&2
    return 1
  fi
  row=$(grep '^detour-wanem' "$file" | awk '{ print $(NF-2), $(NF-1), $NF }')
  read -r CEILING_MBIT_1 CEILING_MBIT_8 CEILING_MBIT_16 <<<"$row"
  if ! [[ "$CEILING_MBIT_1" =~ ^[0-9.]+$ && "$CEILING_MBIT_8" =~ ^[0-9.]+$ &&
          "$CEILING_MBIT_16" =~ ^[0-9.]+$ ]]; then
    echo "measure_ceiling: no ceiling in the forwarder's measurement:" >&2
    cat "$file" >&2
    return 1
  fi
  CEILING_GBYTES=$(awk -v a="$CEILING_MBIT_8" -v b="$CEILING_MBIT_16" \
    'BEGIN { m = a < b ? a : b; printf "%.4f", m / 8000 }')
  CEILING_LINE="forwarder ceiling in this run: $CEILING_MBIT_1 Mbit/s on one stream,"
  CEILING_LINE+=" $CEILING_MBIT_8 on 8, $CEILING_MBIT_16 on 16 (${CEILING_GBYTES} GB/s over several)"
  echo "$CEILING_LINE"
}

# scale_under_ceiling CLUSTER GBYTES: the bandwidth scale (two digits,
# rounded down, within [0.01, 1]) that brings the cluster's fastest region
# link under GBYTES, the ceiling measure_ceiling found.
scale_under_ceiling() {
  python3 - "$1" "$2" <<'PY'
import json, math, sys
d = json.load(open(sys.argv[1]))
fastest = max(l["bandwidth_gbytes_per_s"] for l in d["links"])
print(max(0.01, min(1.0, math.floor(float(sys.argv[2]) / fastest * 100) / 100)))
PY
}
