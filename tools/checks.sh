#!/usr/bin/env bash
# The checked builds CI runs besides `make test` (issue 12), each in its own
# build directory, all with clang from Debian:
#   1. thread safety: the whole tree with -Wthread-safety, its findings errors
#      (every ABSL_GUARDED_BY / EXCLUSIVE_LOCKS_REQUIRED is checked);
#   2. AddressSanitizer + UndefinedBehaviorSanitizer over the LibTorch-free
#      suite (common, coordinator, planner, simulator, transport, net,
#      metrics, work queue, model core, control client, fuzz corpus
#      replays), then every LibTorch-free fuzz target
#      for a short run on its corpus (the same instrumented build);
#   3. ThreadSanitizer over the transport, net, work-queue and control-client
#      tests, with abseil's synchronisation made visible to TSan
#      (tests/tsan/absl_sync_annotations.cc), narrow suppressions for the
#      uninstrumented libraries (tests/tsan/tsan.supp), and a canary race
#      that must be reported.
# The worker's LibTorch code and the end-to-end tests run under none of the
# sanitizers: Debian's LibTorch is not instrumented (docs/DEVELOPMENT.md).
#
#   tools/checks.sh [tsa|asan|tsan ...]     (default: all three)
#   FUZZ_SECONDS=20 by default.
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG=${CLANG:-clang++-14}
JOBS=${JOBS:-$(nproc)}
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
command -v "$CLANG" >/dev/null || { echo "checks: $CLANG not found (tools/install_deps.sh)" >&2; exit 1; }
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tsa asan tsan)

configure() {  # configure DIR FLAGS... : cmake with clang, logs on failure
  local dir=$1; shift
  mkdir -p "$dir"
  cmake -S . -B "$dir" -DCMAKE_CXX_COMPILER="$CLANG" -DDETOUR_BUILD_BENCHMARKS=OFF "$@" \
    > "$dir/configure.log" 2>&1 || { cat "$dir/configure.log"; exit 1; }
}

for step in "${steps[@]}"; do
  case $step in
    tsa)
      echo "== checks: clang -Wthread-safety -Werror=thread-safety (build-tsa)"
      configure build-tsa -DCMAKE_BUILD_TYPE=Debug -DDETOUR_BUILD_TESTS=OFF \
        -DCMAKE_CXX_FLAGS="-Wthread-safety -Werror=thread-safety"
      cmake --build build-tsa -j"$JOBS"
      ;;
    asan)
      echo "== checks: AddressSanitizer + UBSan suite and fuzz targets (build-asan)"
      configure build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDETOUR_WITH_TORCH=OFF \
        -DDETOUR_FUZZ=ON -DDETOUR_TEST_TIMEOUT_SCALE=5 \
        -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fsanitize=fuzzer-no-link -fno-omit-frame-pointer" \
        -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined"
      cmake --build build-asan -j"$JOBS"
      # Planner tests that repeat the same code paths with big search budgets
      # (several minutes under ASan) are left to `make test`; the property
      # test and the reference-example regression still run here.
      (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
        DETOUR_SOURCE_DIR="$PWD/.." ctest --output-on-failure -j"$JOBS" \
        -E "ShippedExampleOrderingAndQuality|PlanJsonRoundTripsThroughSimulate|KeepsAGivenAssignmentAndIsDeterministic|SchedulerComesFromJobUnlessOverridden|DeterministicForASeed|KfacOnThePlannedExample|CompareTableOnShippedExample")
      for t in frame_decoder direct_frames job_spec route_decoder job_record checkpoint_manifest stage_file safetensors; do
        mkdir -p "build-asan/fuzz-corpus/$t" "build-asan/fuzz-artifacts/$t"
        echo "-- fuzz $t ${FUZZ_SECONDS}s"
        "build-asan/tests/fuzz/${t}_fuzzer" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 \
          -max_len=65536 -artifact_prefix="build-asan/fuzz-artifacts/$t/" \
          "build-asan/fuzz-corpus/$t" "tests/fuzz/corpus/$t" > "build-asan/fuzz-$t.log" 2>&1 ||
          { tail -40 "build-asan/fuzz-$t.log"; echo "checks: fuzz target $t crashed" >&2; exit 1; }
      done
      ;;
    tsan)
      echo "== checks: ThreadSanitizer over transport, net, work queue, control client (build-tsan)"
      # DETOUR_TSAN links tests/tsan/absl_sync_annotations.cc into the tests:
      # Debian's abseil is not instrumented, so without it TSan sees no
      # ordering through absl::Mutex at all.
      configure build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDETOUR_WITH_TORCH=OFF \
        -DDETOUR_TSAN=ON -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
        -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread"
      cmake --build build-tsan -j"$JOBS" --target transport_test direct_transport_test net_test \
        runtime_work_queue_test worker_control_client_test tsan_canary
      tsan_options="suppressions=$PWD/tests/tsan/tsan.supp report_signal_unsafe=0"
      # The canary's deliberate race in a reactor gRPC runs must be reported,
      # or the suppressions hide races in our code.
      if TSAN_OPTIONS="$tsan_options" build-tsan/tests/tsan/tsan_canary > build-tsan/canary.log 2>&1 ||
          ! grep -q "data race .*RacySink::Allocate" build-tsan/canary.log; then
        tail -20 build-tsan/canary.log
        echo "checks: TSan did not report the canary's race: tests/tsan/tsan.supp hides races" >&2
        exit 1
      fi
      for t in tests/transport/transport_test tests/transport/direct_transport_test tests/net/net_test \
          tests/runtime/runtime_work_queue_test \
          tests/worker/worker_control_client_test; do
        TSAN_OPTIONS="halt_on_error=1 $tsan_options" DETOUR_SOURCE_DIR="$PWD" "build-tsan/$t"
      done
      ;;
    *) echo "checks: unknown step $step (tsa, asan, tsan)" >&2; exit 2 ;;
  esac
done
echo "checks: all passed"
