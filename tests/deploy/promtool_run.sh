#!/bin/sh
# Runs promtool with the given arguments; exit 77 (ctest: skipped) when it
# is not installed (tools/install_deps.sh installs it).
if ! command -v promtool >/dev/null 2>&1; then
  echo "promtool not found; run tools/install_deps.sh" >&2
  exit 77
fi
exec promtool "$@"
