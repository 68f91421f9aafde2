#!/usr/bin/env bash
# The C++ layout (.clang-format) for every tracked .cc/.h file but the fuzz
# corpora, with Debian's clang-format-14 (tools/install_deps.sh).
#
#   tools/format.sh           rewrite the files in place
#   tools/format.sh --check   list the files that differ and exit 1 (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-clang-format-14}
command -v "$CLANG_FORMAT" >/dev/null ||
  { echo "format: $CLANG_FORMAT not found (tools/install_deps.sh installs clang-format-14)" >&2; exit 1; }
mapfile -t files < <(git ls-files '*.cc' '*.h' | grep -v '^tests/fuzz/corpus/')
case "${1:-}" in
  --check)
    # One clang-format for every file (one per file took a minute): it names
    # each file that differs on stderr, "FILE:LINE:COL: error: code should
    # be clang-formatted".
    rc=0
    out=$("$CLANG_FORMAT" --dry-run --Werror "${files[@]}" 2>&1 >/dev/null) || rc=$?
    mapfile -t bad < <(sed -n 's/^\(.*\):[0-9]*:[0-9]*: error: code should be clang-formatted.*/\1/p' \
      <<< "$out" | sort -u)
    if [[ ${#bad[@]} -gt 0 ]]; then
      printf 'format: %s\n' "${bad[@]}" >&2
      echo "format: ${#bad[@]} of ${#files[@]} files differ from .clang-format; run tools/format.sh" >&2
      exit 1
    fi
    if [[ $rc -ne 0 ]]; then
      echo "$out" | head -20 >&2
      echo "format: $CLANG_FORMAT failed (exit $rc)" >&2
      exit 1
    fi
    echo "format: ${#files[@]} files follow .clang-format"
    ;;
  "") "$CLANG_FORMAT" -i "${files[@]}" ;;
  *) echo "usage: tools/format.sh [--check]" >&2; exit 2 ;;
esac
