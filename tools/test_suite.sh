#!/usr/bin/env bash
# make test: the whole suite of one build, under the rule the checked builds
# follow (tools/retry_record.sh). 821 tests, about a hundred of them real
# processes talking over gRPC or through the WAN test bed, share two cores;
# a timing-dependent assertion can miss once under that load. A test that
# fails gets one more try; a test that fails twice fails the suite; the end
# of the output names every test that needed the retry, and a test that
# needed it in the previous recorded run too fails the suite unless
# tests/flaky_tests.txt names it with its cause.
#
#   tools/test_suite.sh BUILD_DIR [ctest arguments...]
# The record: $DETOUR_CHECKS_RECORD with .suite appended (by default
# ~/.local/state/detour/checks-retried.txt.suite), kept apart from the
# checked builds' record.
set -euo pipefail
if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  [[ $# -ge 1 ]] && exit 0 || exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "$1" && pwd) || { echo "test_suite: no build directory $1" >&2; exit 2; }
shift
RETRY_WHO=suite
source "$ROOT/tools/retry_record.sh"
RECORD=$CHECKS_RECORD.suite
log=$(mktemp)
trap 'rm -f "$RETRIED_NOW" "$log"' EXIT

# The costliest tests first, in a fresh build too.
"$ROOT/tools/test_costs.sh" seed "$build"
rc=0
(cd "$build" && DETOUR_SOURCE_DIR=$ROOT DETOUR_BUILD_DIR=$build \
   ctest --output-on-failure "${RETRY[@]}" "$@") 2>&1 | tee "$log" || rc=$?
retried "$log" "$(basename "$build")"
[[ $rc -eq 0 ]] || exit "$rc"
retry_summary
