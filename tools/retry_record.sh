# Sourced by tools/checks.sh and tools/test_suite.sh: one more try for a test
# that fails once, and a record across runs so that a test which needs the
# retry run after run is not hidden by it.
#
# The caller sets ROOT (the source tree) and RETRY_WHO (the prefix of the
# messages) before sourcing this, and RECORD (the file that keeps the names
# retried in the last recorded run: CHECKS_RECORD for the checked builds,
# CHECKS_RECORD.suite for make test) before retry_summary. A test named in
# tests/flaky_tests.txt, with its cause, may need the retry in two recorded
# runs in a row; any other test that does fails the run (docs/DEVELOPMENT.md).

CHECKS_RECORD=${DETOUR_CHECKS_RECORD:-${XDG_STATE_HOME:-$HOME/.local/state}/detour/checks-retried.txt}
RETRY=(--repeat until-pass:2)
RETRIED_NOW=$(mktemp)
trap 'rm -f "$RETRIED_NOW"' EXIT

# retried LOG WHAT: names the tests whose first attempt failed and adds them
# to this run's list. (grep finds nothing on a clean run: its status must not
# end the script under set -e.)
retried() {
  local names
  # ctest pads the counter to the total's width (" 6/42 Test #317: ..."):
  # leading spaces are part of the line.
  names=$(grep -E '^ *[0-9]+/[0-9]+ Test +#[0-9]+: .*\*\*\*(Failed|Timeout|Exception)' "$1" |
            sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) .*/\1/' | sort -u) || true
  if [[ -n "$names" ]]; then
    echo "$RETRY_WHO: $2: failed once and passed on the retry: $(echo $names)"
    echo "$names" >> "$RETRIED_NOW"
  fi
  RAN_RETRY_STEP=1
  return 0
}

# retry_summary: the end of a run that ran ctest steps with RETRY. Names
# every test that needed a retry; fails when one also needed it in the
# previous recorded run and tests/flaky_tests.txt does not name it; records
# this run.
retry_summary() {
  local now previous repeat known t
  [[ -n ${RAN_RETRY_STEP:-} ]] || return 0
  now=$(sort -u "$RETRIED_NOW")
  previous=$( [[ -f "$RECORD" ]] && sort -u "$RECORD" || true)
  mkdir -p "$(dirname "$RECORD")"
  printf '%s\n' "$now" | sed '/^$/d' > "$RECORD.tmp" && mv "$RECORD.tmp" "$RECORD"
  if [[ -z "$now" ]]; then
    echo "$RETRY_WHO: no test needed a retry"
    return 0
  fi
  echo "$RETRY_WHO: tests that needed a retry in this run: $(echo $now)"
  repeat=$(comm -12 <(printf '%s\n' "$now") <(printf '%s\n' "$previous") | sed '/^$/d')
  [[ -z "$repeat" ]] && return 0
  known=$(sed -E 's/#.*//; s/[[:space:]].*//; /^$/d' "$ROOT/tests/flaky_tests.txt" | sort -u)
  local bad=()
  for t in $repeat; do
    if grep -qxF "$t" <<<"$known"; then
      echo "$RETRY_WHO: $t needed a retry in the previous recorded run too; known flaky (tests/flaky_tests.txt)"
    else
      bad+=("$t")
    fi
  done
  if [[ ${#bad[@]} -gt 0 ]]; then
    echo "$RETRY_WHO: needed a retry in this run and in the previous recorded run ($RECORD): ${bad[*]}" >&2
    echo "$RETRY_WHO: fix the cause, or name the test in tests/flaky_tests.txt with its cause" >&2
    return 1
  fi
}
