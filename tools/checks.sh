#!/usr/bin/env bash
# The checked builds CI runs besides `make test` (issue 12), all with clang
# from Debian, each in its own build directory. What runs under which
# sanitizer, and why, is in docs/DEVELOPMENT.md §"Checked builds and fuzzing".
#
#   asan  (build-asan) the whole tree, LibTorch code included, with
#         -Wthread-safety -Werror=thread-safety (every ABSL_GUARDED_BY /
#         EXCLUSIVE_LOCKS_REQUIRED checked) and AddressSanitizer + UBSan +
#         LeakSanitizer on our code (Debian's LibTorch, gRPC and abseil are not
#         instrumented; ASan still sees every malloc/free in the process). Runs
#         the suite under ctest — unit, model, runtime, worker and the
#         end-to-end tests with sanitized daemons — and fails on any report
#         from any process (log_path below), then every fuzz target for
#         FUZZ_SECONDS on its corpus (same build).
#   tsan  (build-tsan) ThreadSanitizer over the transport, net, work-queue,
#         control-client and runtime tests (the runtime's LibTorch parts with
#         one intra-op thread), abseil's synchronisation made visible
#         (tests/tsan/absl_sync_annotations.cc), narrow suppressions for the
#         uninstrumented libraries (tests/tsan/tsan.supp) and a canary race
#         that must be reported; then the e2e subset labelled `sanitized`
#         (build-asan's tests and workers) against a TSan coordinator.
#   tsa   (build-tsa) the thread-safety analysis alone (quick; `asan` does it
#         too, so CI does not run this one).
#
#   tools/checks.sh [asan|tsan|tsa ...]     (default: asan tsan)
#   FUZZ_SECONDS=20 by default; JOBS=$(nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CLANG=${CLANG:-clang++-14}
JOBS=${JOBS:-$(nproc)}
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
command -v "$CLANG" >/dev/null || { echo "checks: $CLANG not found (tools/install_deps.sh)" >&2; exit 1; }
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(asan tsan)

TSA_FLAGS="-Wthread-safety -Werror=thread-safety"
# -O1 and line tables: sanitizer reports name file:line; full debug info only
# makes the LibTorch objects larger and the links slower.
OPT_FLAGS=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG")
# Planner tests that repeat the same code paths with big search budgets
# (several minutes each under ASan) are left to `make test` (eight); the
# property test and the reference-example regression still run.
ASAN_SKIP="ShippedExampleOrderingAndQuality|PlanJsonRoundTripsThroughSimulate|KeepsAGivenAssignmentAndIsDeterministic|SchedulerComesFromJobUnlessOverridden|DeterministicForASeed|KfacOnThePlannedExample|KfacReplicaSyncOnThePlannedExample|CompareTableOnShippedExample"

configure() {  # configure DIR FLAGS... : cmake with clang, logs on failure
  local dir=$1; shift
  mkdir -p "$dir"
  cmake -S . -B "$dir" -DCMAKE_CXX_COMPILER="$CLANG" -DDETOUR_BUILD_BENCHMARKS=OFF "$@" \
    > "$dir/configure.log" 2>&1 || { cat "$dir/configure.log"; exit 1; }
}

# fresh_logs DIR: an empty directory for the sanitizer reports of a run.
fresh_logs() { rm -rf "$1"; mkdir -p "$1"; }

# check_logs DIR WHAT: fails when any process of the run wrote a report.
check_logs() {
  local dir=$1 what=$2 reports
  reports=$(find "$dir" -type f -name '*.[0-9]*' | sort)
  [[ -z "$reports" ]] && return 0
  for r in $reports; do echo "==== $r"; head -60 "$r"; done
  echo "checks: $what: sanitizer reports above ($(echo "$reports" | wc -l) files in $dir)" >&2
  exit 1
}

timed() {  # timed LABEL CMD...: runs CMD; prints wall and CPU time and the load
  local label=$1 rc=0 TIMEFORMAT; shift
  TIMEFORMAT="-- $label: %0R s wall, %0U s user + %0S s sys CPU"
  time "$@" || rc=$?
  echo "   (load average after it: $(cut -d' ' -f1-3 /proc/loadavg))"
  return $rc
}

for step in "${steps[@]}"; do
  case $step in
    tsa)
      echo "== checks: clang -Wthread-safety -Werror=thread-safety (build-tsa)"
      configure build-tsa -DCMAKE_BUILD_TYPE=Debug -DDETOUR_BUILD_TESTS=OFF \
        -DCMAKE_CXX_FLAGS="$TSA_FLAGS"
      timed "build-tsa" cmake --build build-tsa -j"$JOBS"
      ;;
    asan)
      echo "== checks: thread-safety analysis, ASan+UBSan+LSan over the suite and e2e, fuzz targets (build-asan)"
      configure build-asan "${OPT_FLAGS[@]}" -DDETOUR_FUZZ=ON -DDETOUR_TEST_TIMEOUT_SCALE=5 \
        -DCMAKE_CXX_FLAGS="$TSA_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined -fsanitize=fuzzer-no-link -fno-omit-frame-pointer" \
        -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined"
      timed "build-asan" cmake --build build-asan -j"$JOBS"
      logs=$ROOT/build-asan/sanitizer-logs
      fresh_logs "$logs"
      rm -rf build-asan/tmp && mkdir -p build-asan/tmp
      # Every process of the run (tests, daemons, tools, their children)
      # writes its reports to $logs/<asan|ubsan>.<pid>; an e2e test also fails
      # on its own daemons' reports (tests/e2e/local_cluster.h). LeakSanitizer
      # runs at every exit; tests/asan/lsan.supp says what it ignores and why.
      asan_env=(
        ASAN_OPTIONS="detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:log_path=$logs/asan"
        UBSAN_OPTIONS="print_stacktrace=1:log_path=$logs/ubsan"
        LSAN_OPTIONS="suppressions=$ROOT/tests/asan/lsan.supp:print_suppressions=0"
        TMPDIR="$ROOT/build-asan/tmp" DETOUR_SOURCE_DIR="$ROOT" DETOUR_BUILD_DIR="$ROOT/build-asan")
      # deploy: packaging checks (install tree, container, manifests), not code.
      (cd build-asan && timed "ctest under ASan" env "${asan_env[@]}" \
        ctest --output-on-failure -j"$JOBS" -LE deploy -E "$ASAN_SKIP")
      check_logs "$logs" "ASan/UBSan/LSan"
      for t in frame_decoder direct_frames job_spec route_decoder job_record checkpoint_manifest stage_file safetensors \
          stage_loader; do
        mkdir -p "build-asan/fuzz-corpus/$t" "build-asan/fuzz-artifacts/$t"
        echo "-- fuzz $t ${FUZZ_SECONDS}s"
        "build-asan/tests/fuzz/${t}_fuzzer" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 \
          -max_len=65536 -artifact_prefix="build-asan/fuzz-artifacts/$t/" \
          "build-asan/fuzz-corpus/$t" "tests/fuzz/corpus/$t" > "build-asan/fuzz-$t.log" 2>&1 ||
          { tail -40 "build-asan/fuzz-$t.log"; echo "checks: fuzz target $t crashed" >&2; exit 1; }
      done
      ;;
    tsan)
      echo "== checks: ThreadSanitizer over transport, net, work queue, control client, runtime; e2e with a TSan coordinator (build-tsan)"
      # DETOUR_TSAN links tests/tsan/absl_sync_annotations.cc into the tests
      # and daemons: Debian's abseil is not instrumented, so without it TSan
      # sees no ordering through absl::Mutex at all.
      # Full debug info (not OPT_FLAGS' line tables): tests/tsan/tsan.supp
      # matches qualified names of inlined frames, which line tables lack.
      configure build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDETOUR_TSAN=ON -DDETOUR_TEST_TIMEOUT_SCALE=5 \
        -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
        -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread"
      tsan_tests=(tests/transport/transport_test tests/transport/direct_transport_test tests/net/net_test tests/runtime/runtime_work_queue_test
                  tests/runtime/runtime_parts_test tests/runtime/runtime_test
                  tests/worker/worker_control_client_test tests/common/log_test
                  tests/metrics/metrics_http_server_test)
      timed "build-tsan" cmake --build build-tsan -j"$JOBS" --target tsan_canary detour-coordinator detour-worker \
        "${tsan_tests[@]##*/}"
      tsan_options="suppressions=$ROOT/tests/tsan/tsan.supp report_signal_unsafe=0"
      # The canary's deliberate race in a reactor gRPC runs must be reported,
      # or the suppressions hide races in our code.
      if TSAN_OPTIONS="$tsan_options" build-tsan/tests/tsan/tsan_canary > build-tsan/canary.log 2>&1 ||
          ! grep -q "data race .*RacySink::Allocate" build-tsan/canary.log; then
        tail -20 build-tsan/canary.log
        echo "checks: TSan did not report the canary's race: tests/tsan/tsan.supp hides races" >&2
        exit 1
      fi
      # LibTorch (not instrumented) computes on the calling thread: its own
      # thread pools' synchronisation is invisible to TSan.
      for t in "${tsan_tests[@]}"; do
        timed "$t" env TSAN_OPTIONS="halt_on_error=1 $tsan_options" OMP_NUM_THREADS=1 \
          DETOUR_SOURCE_DIR="$ROOT" "build-tsan/$t"
      done
      # The e2e subset (label `sanitized`) from build-asan, its coordinator
      # from build-tsan. A race in the coordinator is written to the test's
      # directory (log_path) and fails the test (tests/e2e/local_cluster.h);
      # SanitizerHarnessTest proves it with the canary as a child.
      if [[ ! -x build-asan/tests/e2e/daemons_test ]]; then
        echo "checks: tsan's e2e part runs build-asan's tests: run tools/checks.sh asan tsan" >&2
        exit 1
      fi
      logs=$ROOT/build-tsan/sanitizer-logs
      fresh_logs "$logs"
      rm -rf build-tsan/tmp && mkdir -p build-tsan/tmp
      (cd build-asan && timed "e2e with a TSan coordinator" env \
        TSAN_OPTIONS="$tsan_options log_path=$logs/tsan" \
        ASAN_OPTIONS="detect_leaks=1:log_path=$logs/asan" UBSAN_OPTIONS="print_stacktrace=1:log_path=$logs/ubsan" \
        LSAN_OPTIONS="suppressions=$ROOT/tests/asan/lsan.supp:print_suppressions=0" \
        DETOUR_E2E_COORDINATOR_BUILD_DIR="$ROOT/build-tsan" DETOUR_TSAN_CANARY="$ROOT/build-tsan/tests/tsan/tsan_canary" \
        TMPDIR="$ROOT/build-tsan/tmp" DETOUR_SOURCE_DIR="$ROOT" DETOUR_BUILD_DIR="$ROOT/build-asan" \
        ctest --output-on-failure -j"$JOBS" -L sanitized)
      check_logs "$logs" "TSan (e2e)"
      ;;
    *) echo "checks: unknown step $step (asan, tsan, tsa)" >&2; exit 2 ;;
  esac
done
echo "checks: all passed"
