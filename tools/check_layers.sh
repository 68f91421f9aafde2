#!/usr/bin/env bash
# The include rules of docs/ARCHITECTURE.md §"The layers", over the tree at
# ROOT (default: this checkout): common/ includes nothing of coordinator/,
# worker/ or tools/; coordinator/ nothing of worker/ or tools/; worker/
# nothing of coordinator/ or tools/. Only coordinator/ speaks to etcd: common/
# and worker/ include none of the generated etcd/ protos. Prints each offending include with its
# file and line, and exits 1 if there is one.
#
#   tools/check_layers.sh [ROOT]
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
bad=0
check() {  # check DIR FORBIDDEN...: no file under DIR includes FORBIDDEN/...
  local dir=$1 f hits; shift
  [[ -d "$root/$dir" ]] || return 0
  for f in "$@"; do
    hits=$(grep -rnE "^[[:space:]]*#[[:space:]]*include[[:space:]]+\"$f/" "$root/$dir" \
             --include='*.h' --include='*.cc' || true)
    if [[ -n "$hits" ]]; then
      echo "check_layers: $dir/ must not include $f/:"
      echo "${hits//$root\//}"
      bad=1
    fi
  done
}
check common coordinator worker tools etcd
check coordinator worker tools
check worker coordinator tools etcd
if [[ $bad -ne 0 ]]; then exit 1; fi
echo "check_layers: common/, coordinator/ and worker/ include only what their layer may"
