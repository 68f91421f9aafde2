#!/usr/bin/env bash
# The order ctest starts tests in. With -j, ctest starts the costliest test
# first, by the seconds each took in the build's last runs
# (<build>/Testing/Temporary/CTestCostData.txt); a fresh build has none, and
# ctest then starts them in the order they were declared: the WAN test bed's
# link-fault tests, a minute each and one at a time (lock `wan_bed`), came
# last and left the second core idle for five minutes of `make test`.
# tests/test_costs.txt keeps the measured seconds of every test over one
# second (from a Release run of `make test`, two cores); a build without
# data of its own starts from it. New or renamed tests start after those
# named there; a stale figure only changes the order, never a result.
#
#   tools/test_costs.sh seed BUILD_DIR    copy tests/test_costs.txt into the
#                                         build unless it has data of its own
#   tools/test_costs.sh write BUILD_DIR   rewrite tests/test_costs.txt from the
#                                         build's data (after a `make test`)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
costs=$ROOT/tests/test_costs.txt
usage() { sed -n '13,16p' "$0" | sed 's/^# \{0,1\}//'; }
[[ ${1:-} == -h || ${1:-} == --help ]] && { usage; exit 0; }
[[ $# -eq 2 ]] || { usage >&2; exit 2; }
data=$2/Testing/Temporary/CTestCostData.txt
case $1 in
  seed)
    [[ -d $2 ]] || { echo "test_costs: no build directory $2" >&2; exit 2; }
    [[ -s $data ]] && exit 0
    mkdir -p "$(dirname "$data")"
    # ctest stops reading at a line of fewer than three fields: no comments.
    { grep -v '^#' "$costs"; echo ---; } > "$data"
    ;;
  write)
    [[ -s $data ]] || { echo "test_costs: $data: no cost data (run make test first)" >&2; exit 2; }
    {
      echo "# Seconds each test took in a Release make test on two cores (name, runs, seconds):"
      echo "# the order ctest starts them in when a build has none of its own (tools/test_costs.sh)."
      awk '$0 == "---" { exit } NF == 3 && $3 >= 1 { printf "%s 1 %.1f\n", $1, $3 }' "$data" |
        sort -k3,3nr -k1,1
    } > "$costs.new"
    mv "$costs.new" "$costs"
    echo "test_costs: $(grep -vc '^#' "$costs") tests in $costs"
    ;;
  *) usage >&2; exit 2 ;;
esac
