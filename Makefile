# detour — top-level entry points. Each target installs missing Debian
# packages first (tools/install_deps.sh, fast when all are present), then
# configures and builds with CMake in $(BUILD_DIR).
#
#   make demo    build, then run the local demo (tools/demo.sh)
#   make test    build, then run the whole test suite with ctest
#   make build   just build (Release)
#   make bench   build and run the benchmarks
#   make fuzz    build the libFuzzer targets with clang and run each for
#                FUZZ_SECONDS (default 300) on its corpus (tools/fuzz.sh)
#   make checks-full  the checked builds CI runs after `make build`
#                (tools/checks.sh notorch asan-full tsan-full): the
#                LibTorch-free build with warnings as errors (no tests);
#                ASan+UBSan+LSan with the thread-safety analysis over the
#                suite with LibTorch and the e2e tests labelled `sanitized`,
#                every fuzz target; TSan over the transport, net, runtime and
#                the same e2e tests with a TSan coordinator. CI then runs
#                `tools/checks.sh plain`: the plain build's tests these leave
#                out, so each test of `make test` runs once (docs/DEVELOPMENT.md)
#   make checks  quicker checked builds for development, covered by
#                checks-full (tools/checks.sh: thread-safety analysis,
#                ASan+UBSan and TSan over the LibTorch-free suite)
#   make format  lay the C++ out as .clang-format says (CI checks it)
#   make clean   remove the build directory

BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=
CTEST_FLAGS ?=

FUZZ_SECONDS ?= 300

# ccache hits across clones in other folders (CI builds a fresh clone): paths
# under the tree are hashed relative to it, and the working directory is left
# out of the hash of builds with debug line tables (the sanitized builds).
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= 1

.PHONY: all deps configure build test demo bench fuzz checks checks-full format clean

all: build

deps:
	@tools/install_deps.sh

$(BUILD_DIR)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

configure: deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD_DIR) -j$(JOBS)

# A test that fails gets one retry, and the end names it (tools/test_suite.sh).
test: build
	tools/test_suite.sh $(BUILD_DIR) -j$(JOBS) $(CTEST_FLAGS)

demo: build
	@DETOUR_BUILD_DIR=$(CURDIR)/$(BUILD_DIR) tools/demo.sh

bench: build
	@tools/run_benchmarks.sh $(BUILD_DIR)

fuzz: deps
	tools/fuzz.sh $(FUZZ_SECONDS) build-fuzz

checks: deps
	tools/checks.sh

checks-full: deps
	tools/checks.sh notorch asan-full tsan-full

format: deps
	tools/format.sh

clean:
	rm -rf $(BUILD_DIR)
