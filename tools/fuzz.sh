#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (AddressSanitizer and
# UndefinedBehaviorSanitizer on; no LibTorch, no tests) and runs each on its
# corpus (tests/fuzz/corpus/<target>) for a while.
#
#   tools/fuzz.sh [SECONDS_PER_TARGET] [BUILD_DIR]     (defaults: 60, build-fuzz)
#   tools/fuzz.sh --ci                                  (20 s each, for CI)
#
# New interesting inputs go to BUILD_DIR/fuzz-corpus/<target> (the repo's
# corpus stays as committed). A crash stops the run with status 1 and leaves
# the input as BUILD_DIR/fuzz-artifacts/<target>/crash-*: fix the bug, then
# copy the input into tests/fuzz/corpus/<target>/ so the replay test in
# `make test` keeps it fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=60
if [[ "${1:-}" == "--ci" ]]; then SECONDS_EACH=20; shift; elif [[ -n "${1:-}" ]]; then SECONDS_EACH=$1; shift; fi
BUILD=${1:-build-fuzz}
CLANG=${CLANG:-clang++-14}
command -v "$CLANG" >/dev/null || { echo "fuzz: $CLANG not found (tools/install_deps.sh installs clang-14)" >&2; exit 1; }
mkdir -p "$BUILD"
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fsanitize=fuzzer-no-link"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$CLANG" \
  -DDETOUR_FUZZ=ON -DDETOUR_WITH_TORCH=OFF -DDETOUR_BUILD_TESTS=OFF -DDETOUR_BUILD_BENCHMARKS=OFF \
  -DCMAKE_CXX_FLAGS="$SAN -fno-omit-frame-pointer" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" > "$BUILD/configure.log" 2>&1 ||
  { cat "$BUILD/configure.log"; exit 1; }
TARGETS=(frame_decoder direct_frames job_spec route_decoder job_record checkpoint_manifest stage_file safetensors)
cmake --build "$BUILD" -j"$(nproc)" --target "${TARGETS[@]/%/_fuzzer}"
status=0
for t in "${TARGETS[@]}"; do
  corpus="$BUILD/fuzz-corpus/$t"
  artifacts="$BUILD/fuzz-artifacts/$t"
  mkdir -p "$corpus" "$artifacts"
  echo "== $t: ${SECONDS_EACH}s"
  if ! "$BUILD/tests/fuzz/${t}_fuzzer" -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 \
      -max_len=65536 -artifact_prefix="$artifacts/" -print_final_stats=1 \
      "$corpus" "tests/fuzz/corpus/$t" > "$BUILD/fuzz-$t.log" 2>&1; then
    echo "fuzz: $t found a crash (log: $BUILD/fuzz-$t.log, input in $artifacts/):" >&2
    tail -40 "$BUILD/fuzz-$t.log" >&2
    status=1
  else
    grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb" "$BUILD/fuzz-$t.log" | tr '\n' ' '
    echo
  fi
done
exit $status
