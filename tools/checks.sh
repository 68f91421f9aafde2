#!/usr/bin/env bash
# The checked builds, all with clang from Debian, each in its own build
# directory. What runs under which sanitizer, and why, is in
# docs/DEVELOPMENT.md §"Checked builds and fuzzing".
#
# Full steps (`make checks-full`; CI runs them after `make test`):
#   notorch    (build-notorch) the LibTorch-free configuration with warnings
#         as errors and the thread-safety analysis, tests left out: the
#         coordinator, common/ and the tools must build without LibTorch;
#   asan-full  (build-asan-full) the whole tree, LibTorch code included, with
#         warnings as errors, the thread-safety analysis and ASan + UBSan +
#         LSan on our code; the whole suite under ctest but the e2e tests
#         outside the `sanitized` label, e2e tests with sanitized daemons,
#         failing on any report from any process (log_path), then every fuzz
#         target, stage_loader included;
#   tsan-full  (build-tsan-full) TSan over the transport, net, work-queue,
#         control-client, log and runtime tests (LibTorch with one intra-op
#         thread), then the e2e subset labelled `sanitized` (build-asan-full's
#         tests and workers) against a TSan coordinator. Needs asan-full first.
#   plain  (the plain build in $BUILD_DIR, default build; `make build` first)
#         the tests asan-full leaves out, under tools/test_suite.sh's rule:
#         the e2e tests outside `sanitized`, SANITIZED_SKIP, ASAN_SKIP, the
#         deploy label, and PLAIN_TOO (tests whose plain run checks more than
#         their sanitized one). With asan-full, every test of `make test` runs
#         once, sanitized where it can be; CI runs these four steps after
#         `make build` instead of `make test` and the three full steps.
#
# Quicker steps for development (`make checks`, not run by CI: the full steps
# cover them):
#   tsa   (build-tsa) the whole tree with -Wthread-safety -Werror=thread-safety;
#   asan  (build-asan) ASan + UBSan over the LibTorch-free suite, then the
#         LibTorch-free fuzz targets for FUZZ_SECONDS;
#   tsan  (build-tsan) TSan over the transport, net, work-queue, control-client
#         and log tests, abseil's synchronisation made visible
#         (tests/tsan/absl_sync_annotations.cc), narrow suppressions for the
#         uninstrumented libraries (tests/tsan/tsan.supp) and a canary race
#         that must be reported.
#
# A sanitized test that fails once gets one retry; the run ends by naming every
# test that needed one, and fails when a test needed one in this run and in
# the previous recorded run too, unless tests/flaky_tests.txt names it with
# its cause (the record: $DETOUR_CHECKS_RECORD, by default
# ~/.local/state/detour/checks-retried.txt).
#
#   tools/checks.sh [notorch|tsa|asan|tsan|asan-full|tsan-full|plain ...]  (default: tsa asan tsan)
#   FUZZ_SECONDS=20 by default; JOBS=$(nproc); DETOUR_UNITY_BUILD=ON builds
#   in batches (CMakeLists.txt; CI's setting).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CLANG=${CLANG:-clang++-14}
JOBS=${JOBS:-$(nproc)}
UNITY=${DETOUR_UNITY_BUILD:-OFF}
PLAIN_BUILD=${BUILD_DIR:-build}
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
command -v "$CLANG" >/dev/null || { echo "checks: $CLANG not found (tools/install_deps.sh)" >&2; exit 1; }
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tsa asan tsan)

TSA_FLAGS="-Wthread-safety -Werror=thread-safety"
# libFuzzer's coverage only on the sources the fuzz targets parse with
# (DETOUR_FUZZ_COVERAGE=parsers, tests/fuzz/CMakeLists.txt): on every source
# it slowed the whole suite's planning about twofold. `make fuzz` covers all.
ASAN_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# -O1 and line tables for the full build: sanitizer reports name file:line;
# full debug info only makes the LibTorch objects larger and the links slower.
OPT_FLAGS=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG")
# Planner tests that repeat the same code paths with big search budgets
# (one to several minutes each under ASan) are left to `make test`; the
# property test and the reference-example regression still run. The last
# five (272 s of ASan test time in the last clean-clone CI): the search never
# worse than its starts, the refitted model against measured routes and the
# three baselines. So are the link-fault runs over the WAN test bed
# (LinkFaultWanTest): minutes of training each, bounded by budgets that
# assume an unsanitized build; the test bed's own namespace tests and
# detour-local --wan still run sanitized.
ASAN_SKIP_TESTS=(LinkFaultWanTest ShippedExampleOrderingAndQuality PlanJsonRoundTripsThroughSimulate
  KeepsAGivenAssignmentAndIsDeterministic SchedulerComesFromJobUnlessOverridden DeterministicForASeed
  KfacOnThePlannedExample KfacReplicaSyncOnThePlannedExample CompareTableOnShippedExample
  NeverWorseThanItsStarts ARefittedModelMustBeatWhatTheRoutesMeasured "BaselinesTest\\.")
ASAN_SKIP=$(IFS='|'; echo "${ASAN_SKIP_TESTS[*]}")
# The e2e tests the sanitized runs leave to `make test`: each walks code paths
# another test of the `sanitized` label walks too (named after each), and the
# sanitized e2e runs must fit CI's time. The plain job's kill, empty stage
# and stall (their K-FAC or single-stall twins stay), two of the four resumes
# (ResumeOnOtherReplicaCounts and ResumeOnSkipSpecsIsBitExact stay), the spare
# replica taken (SpareReplicaMovesToAThinSlowStage stays), and the slow replica
# routed around (a planner choice from measured speeds: timing-dependent under
# a sanitizer's slowdown).
SANITIZED_SKIP_TESTS=(KilledReplicaJobGoesOn EmptyStageIsSkippedThenRefilled
  TwoStallsComeBackAndRefillTwoShortStages ResumeEqualsAStraightRunBitForBit
  ResumeOnAPreparedDatasetContinuesItsDataPosition StageLosingAllReplicasTakesASpareReplica
  SlowReplicaIsRoutedAroundAndNamed)
# TSan instruments the coordinator only (the workers are build-asan-full's):
# it also leaves out three tests whose work is the workers', not the
# coordinator's. The bit-exact resume on skip specs (ResumeOnOtherReplicaCounts
# walks the coordinator's resume; it took 247 s against a TSan coordinator,
# the longest of the run), a data node killed (KilledReplicaOfAKfacJobGoesOn
# walks the coordinator's loss) and a member flooding next-iteration frames
# (the receiving workers' bound).
TSAN_E2E_SKIP_TESTS=("${SANITIZED_SKIP_TESTS[@]}" ResumeOnSkipSpecsIsBitExact
  KilledDataNodeJobGoesOn AMemberFloodingNextIterationFramesEvictsNobody)
elastic_tests_regex() { local IFS='|'; echo "ElasticTest\\.($*)\$"; }
SANITIZED_SKIP=$(elastic_tests_regex "${SANITIZED_SKIP_TESTS[@]}")
# Tests asan-full runs that the plain step runs again, because sanitized they
# check less (tests/sanitized.h): the path scheduler's property test walks
# 100 random clusters sanitized and 300 plain.
PLAIN_TOO_TESTS=("PathSchedulerPropertyTest\\.")
PLAIN_TOO=$(IFS='|'; echo "${PLAIN_TOO_TESTS[*]}")
# The tests asan-full runs (ctest filters): every test but the e2e ones, the
# packaging checks and ASAN_SKIP; then the e2e tests labelled `sanitized` but
# SANITIZED_SKIP. The plain step runs what these leave out.
ASAN_UNIT_FILTER=(-LE "deploy|e2e" -E "$ASAN_SKIP")
ASAN_E2E_FILTER=(-L sanitized -E "$SANITIZED_SKIP")
TSAN_E2E_SKIP=$(elastic_tests_regex "${TSAN_E2E_SKIP_TESTS[@]}")
# The LibTorch-free fuzz targets (default asan) and the one that needs LibTorch.
FUZZ_TARGETS=(frame_decoder direct_frames job_spec route_decoder job_record checkpoint_manifest stage_file safetensors)
TORCH_FUZZ_TARGETS=(stage_loader)
# TSan tests of the default step (LibTorch-free), and those asan-full adds.
# (metrics_http_server_test is in neither: TSan reports races inside Debian's
# civetweb, gmtime and tzset on its worker threads; docs/DEVELOPMENT.md.)
TSAN_TESTS=(tests/transport/transport_test tests/transport/direct_transport_test
            tests/transport/connection_admission_test tests/net/net_test tests/net/admission_relay_test
            tests/runtime/runtime_work_queue_test tests/worker/worker_control_client_test
            tests/common/log_test)
TSAN_FULL_TESTS=(tests/runtime/runtime_parts_test tests/runtime/runtime_test)
TSAN_OPTIONS_BASE="suppressions=$ROOT/tests/tsan/tsan.supp report_signal_unsafe=0"

configure() {  # configure DIR FLAGS... : cmake with clang, logs on failure
  local dir=$1; shift
  mkdir -p "$dir"
  cmake -S . -B "$dir" -DCMAKE_CXX_COMPILER="$CLANG" -DDETOUR_BUILD_BENCHMARKS=OFF \
    -DDETOUR_UNITY_BUILD="$UNITY" "$@" \
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

# The full steps run the e2e tests at ASan's/TSan's 2-10x slowdown, where a
# timing-dependent assertion (a planner choice from measured speeds, a
# deadline) can miss once. Such a test gets one more try (RETRY, from
# tools/retry_record.sh, which make test shares); a test that fails twice
# fails the step, and a sanitizer report in the run's log directory from any
# attempt fails it too (check_logs). An e2e test's own processes report into
# the test's directory and fail that test, which the retry can pass
# (docs/DEVELOPMENT.md). Failed attempts stay in the output and are listed by
# retried and retry_summary.
RETRY_WHO=checks
source "$ROOT/tools/retry_record.sh"
RECORD=$CHECKS_RECORD

timed() {  # timed LABEL CMD...: runs CMD; prints wall and CPU time and the load
  local label=$1 rc=0 TIMEFORMAT; shift
  TIMEFORMAT="-- $label: %0R s wall, %0U s user + %0S s sys CPU"
  time "$@" || rc=$?
  echo "   (load average after it: $(cut -d' ' -f1-3 /proc/loadavg))"
  return $rc
}

fuzz() {  # fuzz BUILD_DIR TARGET...: each target FUZZ_SECONDS on its corpus, JOBS at a time
  # (a fuzzer runs on one thread: two side by side halve the step's time).
  local dir=$1 t failed=(); shift
  for t in "$@"; do
    while [[ $(jobs -rp | wc -l) -ge $JOBS ]]; do wait -n || true; done
    mkdir -p "$dir/fuzz-corpus/$t" "$dir/fuzz-artifacts/$t"
    rm -f "$dir/fuzz-$t.rc"
    echo "-- fuzz $t ${FUZZ_SECONDS}s"
    ( rc=0
      "$dir/tests/fuzz/${t}_fuzzer" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 \
        -max_len=65536 -artifact_prefix="$dir/fuzz-artifacts/$t/" \
        "$dir/fuzz-corpus/$t" "tests/fuzz/corpus/$t" > "$dir/fuzz-$t.log" 2>&1 || rc=$?
      echo "$rc" > "$dir/fuzz-$t.rc" ) &
  done
  wait
  for t in "$@"; do
    if [[ "$(cat "$dir/fuzz-$t.rc" 2>/dev/null)" != 0 ]]; then
      tail -40 "$dir/fuzz-$t.log"
      failed+=("$t")
    fi
  done
  if [[ ${#failed[@]} -gt 0 ]]; then
    echo "checks: fuzz target(s) crashed: ${failed[*]} (logs: $dir/fuzz-<target>.log)" >&2
    exit 1
  fi
}

tsan_canary() {  # tsan_canary BUILD_DIR: the canary's race must be reported
  # The canary races on purpose in a reactor gRPC runs: if TSan does not
  # report it, the suppressions hide races in our code.
  local dir=$1
  if TSAN_OPTIONS="$TSAN_OPTIONS_BASE" "$dir/tests/tsan/tsan_canary" > "$dir/canary.log" 2>&1 ||
      ! grep -q "data race .*RacySink::Allocate" "$dir/canary.log"; then
    tail -20 "$dir/canary.log"
    echo "checks: TSan did not report the canary's race: tests/tsan/tsan.supp hides races" >&2
    exit 1
  fi
}

tsan_run() {  # tsan_run BUILD_DIR TEST...: each test binary, halting on a report
  local dir=$1 t; shift
  # LibTorch (not instrumented) computes on the calling thread with one
  # intra-op thread: its own pools' synchronisation is invisible to TSan.
  for t in "$@"; do
    timed "$t" env TSAN_OPTIONS="halt_on_error=1 $TSAN_OPTIONS_BASE" OMP_NUM_THREADS=1 \
      DETOUR_SOURCE_DIR="$ROOT" "$dir/$t"
  done
}

test_names() {  # test_names BUILD_DIR CTEST_FILTER...: the names of the tests ctest selects
  local dir=$1; shift
  (cd "$dir" && ctest -N "$@") | sed -n 's/^ *Test *#[0-9]*: //p' | sort -u
}

plain_numbers() {  # plain_numbers: PLAIN_BUILD's numbers of the tests asan-full leaves out, and PLAIN_TOO
  local covered
  covered=$( (test_names build-asan-full "${ASAN_UNIT_FILTER[@]}"
              test_names build-asan-full "${ASAN_E2E_FILTER[@]}") | sort -u)
  (cd "$PLAIN_BUILD" && ctest -N) | sed -n 's/^ *Test *#\([0-9]*\): \(.*\)$/\1\t\2/p' |
    PLAIN_TOO="$PLAIN_TOO" awk -F '\t' 'NR == FNR { covered[$0] = 1; next }
      !($2 in covered) || $2 ~ ENVIRON["PLAIN_TOO"] { print $1 }' <(echo "$covered") -
}

for step in "${steps[@]}"; do
  case $step in
    notorch)
      echo "== checks (full): LibTorch-free build, warnings as errors, thread-safety analysis (build-notorch)"
      # The build is the check, tests left out: their sources are those
      # `make test` and asan-full build and run (no source tests
      # DETOUR_WITH_TORCH), and asan-full has the thread-safety analysis too.
      configure build-notorch -DCMAKE_BUILD_TYPE=Debug -DDETOUR_WITH_TORCH=OFF -DDETOUR_WERROR=ON \
        -DDETOUR_BUILD_TESTS=OFF -DCMAKE_CXX_FLAGS_DEBUG="-O0" -DCMAKE_CXX_FLAGS="$TSA_FLAGS"
      timed "build-notorch" cmake --build build-notorch -j"$JOBS"
      ;;
    tsa)
      echo "== checks: clang -Wthread-safety -Werror=thread-safety (build-tsa)"
      configure build-tsa -DCMAKE_BUILD_TYPE=Debug -DDETOUR_BUILD_TESTS=OFF \
        -DCMAKE_CXX_FLAGS="$TSA_FLAGS"
      timed "build-tsa" cmake --build build-tsa -j"$JOBS"
      ;;
    asan)
      echo "== checks: AddressSanitizer + UBSan suite and fuzz targets, LibTorch-free (build-asan)"
      configure build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDETOUR_WITH_TORCH=OFF \
        -DDETOUR_FUZZ=ON -DDETOUR_FUZZ_COVERAGE=parsers -DDETOUR_TEST_TIMEOUT_SCALE=5 -DCMAKE_CXX_FLAGS="$ASAN_CXX_FLAGS" \
        -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined"
      timed "build-asan" cmake --build build-asan -j"$JOBS"
      (cd build-asan && timed "ctest under ASan" env ASAN_OPTIONS=detect_leaks=1 \
        UBSAN_OPTIONS=print_stacktrace=1 DETOUR_SOURCE_DIR="$ROOT" \
        ctest --output-on-failure --no-tests=error -j"$JOBS" -E "$ASAN_SKIP")
      fuzz build-asan "${FUZZ_TARGETS[@]}"
      ;;
    tsan)
      echo "== checks: ThreadSanitizer over transport, net, work queue, control client, log (build-tsan)"
      # DETOUR_TSAN links tests/tsan/absl_sync_annotations.cc into the tests:
      # Debian's abseil is not instrumented, so without it TSan sees no
      # ordering through absl::Mutex at all.
      configure build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDETOUR_WITH_TORCH=OFF -DDETOUR_TSAN=ON \
        -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
        -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread"
      timed "build-tsan" cmake --build build-tsan -j"$JOBS" --target tsan_canary "${TSAN_TESTS[@]##*/}"
      tsan_canary build-tsan
      tsan_run build-tsan "${TSAN_TESTS[@]}"
      ;;
    asan-full)
      echo "== checks (full): thread-safety analysis, ASan+UBSan+LSan over the suite and the sanitized e2e tests, every fuzz target (build-asan-full)"
      configure build-asan-full "${OPT_FLAGS[@]}" -DDETOUR_FUZZ=ON -DDETOUR_FUZZ_COVERAGE=parsers -DDETOUR_TEST_TIMEOUT_SCALE=5 -DDETOUR_WERROR=ON \
        -DCMAKE_CXX_FLAGS="$TSA_FLAGS $ASAN_CXX_FLAGS" \
        -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined"
      timed "build-asan-full" cmake --build build-asan-full -j"$JOBS"
      logs=$ROOT/build-asan-full/sanitizer-logs
      fresh_logs "$logs"
      rm -rf build-asan-full/tmp && mkdir -p build-asan-full/tmp
      # Every process of the run (tests, daemons, tools, their children)
      # writes its reports to $logs/<asan|ubsan>.<pid>; an e2e test also fails
      # on its own daemons' reports (tests/e2e/local_cluster.h). LeakSanitizer
      # runs at every exit; tests/asan/lsan.supp says what it ignores and why.
      asan_env=(
        ASAN_OPTIONS="detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:log_path=$logs/asan"
        UBSAN_OPTIONS="print_stacktrace=1:log_path=$logs/ubsan"
        LSAN_OPTIONS="suppressions=$ROOT/tests/asan/lsan.supp:print_suppressions=0"
        TMPDIR="$ROOT/build-asan-full/tmp" DETOUR_SOURCE_DIR="$ROOT" DETOUR_BUILD_DIR="$ROOT/build-asan-full")
      # Every test but the e2e ones and the deploy label (packaging checks:
      # install tree, container, manifests, not code); then the e2e subset
      # labelled `sanitized`, sanitized coordinator, workers and tools.
      (cd build-asan-full && timed "ctest under ASan" env "${asan_env[@]}" \
        ctest --output-on-failure --no-tests=error -j"$JOBS" "${RETRY[@]}" "${ASAN_UNIT_FILTER[@]}" &&
        timed "e2e under ASan" env "${asan_env[@]}" \
        ctest --output-on-failure --no-tests=error -j"$JOBS" "${RETRY[@]}" "${ASAN_E2E_FILTER[@]}") \
        2>&1 | tee build-asan-full/ctest.log
      retried build-asan-full/ctest.log "ASan"
      check_logs "$logs" "ASan/UBSan/LSan"
      fuzz build-asan-full "${FUZZ_TARGETS[@]}" "${TORCH_FUZZ_TARGETS[@]}"
      ;;
    tsan-full)
      echo "== checks (full): ThreadSanitizer over the default tests and the runtime; e2e with a TSan coordinator (build-tsan-full)"
      if [[ ! -x build-asan-full/tests/e2e/daemons_test ]]; then
        echo "checks: tsan-full's e2e part runs build-asan-full's tests: run tools/checks.sh asan-full tsan-full" >&2
        exit 1
      fi
      # DETOUR_TSAN links the annotations into the daemons too. Full debug
      # info (not OPT_FLAGS' line tables): tests/tsan/tsan.supp matches
      # qualified names of inlined frames, which line tables lack.
      # The compiler's own linker here (GNU ld, strict about the order of
      # static libraries), so that CI links the daemons with it too; the
      # other builds take lld (CMakeLists.txt, DETOUR_LINKER).
      configure build-tsan-full -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDETOUR_TSAN=ON -DDETOUR_TEST_TIMEOUT_SCALE=5 -DDETOUR_WERROR=ON \
        -DDETOUR_LINKER=default \
        -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
        -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread"
      full_tests=("${TSAN_TESTS[@]}" "${TSAN_FULL_TESTS[@]}")
      timed "build-tsan-full" cmake --build build-tsan-full -j"$JOBS" --target tsan_canary detour-coordinator \
        detour-worker "${full_tests[@]##*/}"
      tsan_canary build-tsan-full
      tsan_run build-tsan-full "${full_tests[@]}"
      # The e2e subset (label `sanitized`) from build-asan-full, its
      # coordinator from build-tsan-full. A race in the coordinator is written
      # to the test's directory (log_path) and fails the test
      # (tests/e2e/local_cluster.h); SanitizerHarnessTest proves it with the
      # canary as a child.
      logs=$ROOT/build-tsan-full/sanitizer-logs
      fresh_logs "$logs"
      rm -rf build-tsan-full/tmp && mkdir -p build-tsan-full/tmp
      (cd build-asan-full && timed "e2e with a TSan coordinator" env \
        TSAN_OPTIONS="$TSAN_OPTIONS_BASE log_path=$logs/tsan" \
        ASAN_OPTIONS="detect_leaks=1:log_path=$logs/asan" UBSAN_OPTIONS="print_stacktrace=1:log_path=$logs/ubsan" \
        LSAN_OPTIONS="suppressions=$ROOT/tests/asan/lsan.supp:print_suppressions=0" \
        DETOUR_E2E_COORDINATOR_BUILD_DIR="$ROOT/build-tsan-full" \
        DETOUR_TSAN_CANARY="$ROOT/build-tsan-full/tests/tsan/tsan_canary" \
        TMPDIR="$ROOT/build-tsan-full/tmp" DETOUR_SOURCE_DIR="$ROOT" DETOUR_BUILD_DIR="$ROOT/build-asan-full" \
        ctest --output-on-failure --no-tests=error -j"$JOBS" "${RETRY[@]}" -L sanitized -E "$TSAN_E2E_SKIP") \
        2>&1 | tee build-tsan-full/ctest-e2e.log
      retried build-tsan-full/ctest-e2e.log "TSan (e2e)"
      check_logs "$logs" "TSan (e2e)"
      ;;
    plain)
      echo "== checks (full): the plain build's tests that asan-full leaves out ($PLAIN_BUILD)"
      if [[ ! -f $PLAIN_BUILD/CTestTestfile.cmake || ! -f build-asan-full/CTestTestfile.cmake ]]; then
        echo "checks: plain runs $PLAIN_BUILD's tests less asan-full's: make build, then tools/checks.sh asan-full plain" >&2
        exit 1
      fi
      numbers=$(plain_numbers | paste -sd,)
      [[ -n $numbers ]] || { echo "checks: plain: no test left to run in $PLAIN_BUILD" >&2; exit 1; }
      echo "   $(tr ',' '\n' <<<"$numbers" | wc -l) of $(test_names "$PLAIN_BUILD" | wc -l) tests"
      # -I 0,0,0,N,...: no range (stride 0), then these tests by number.
      timed "plain tests" "$ROOT/tools/test_suite.sh" "$PLAIN_BUILD" -j"$JOBS" -I "0,0,0,$numbers"
      ;;
    *) echo "checks: unknown step $step (notorch, tsa, asan, tsan, asan-full, tsan-full, plain)" >&2; exit 2 ;;
  esac
done
retry_summary
echo "checks: all passed"
