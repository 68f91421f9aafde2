#!/usr/bin/env bash
# Checks deploy/Containerfile and the build-context ignore files, and that
# tools/runtime_packages.sh (which picks the runtime image's packages) finds
# runtime packages only. When a container engine answers (docker or podman),
# also builds the image and runs `detourctl --version` and the coordinator's
# --version in it; otherwise says so and exits 77 (CTest: skipped) after the
# static checks passed.
#
#   container_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
file=$src/deploy/Containerfile
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# The last stage (from its FROM on) is what runs.
stages=$(grep -c '^FROM ' "$file")
[[ $stages -ge 2 ]] || fail "Containerfile has $stages stage(s); expected a build and a runtime stage"
# Continuation lines joined, so each instruction is one line.
runtime=$(sed -e ':a' -e '/\\$/N; s/\\\n//; ta' "$file" |
          awk '/^FROM /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}')
grep -q '^FROM .* AS build' "$file" || fail "no build stage (FROM ... AS build)"
user=$(printf '%s' "$runtime" | sed -n 's/^USER \([^: ]*\).*/\1/p' | tail -1)
[[ -n "$user" && "$user" != root && "$user" != 0 ]] || fail "the runtime stage runs as \"${user:-root}\"; expected a non-root USER"
printf '%s' "$runtime" | grep -q '^HEALTHCHECK .*detourctl health' || fail "no HEALTHCHECK with detourctl health (gRPC health)"
printf '%s' "$runtime" | grep -q '^VOLUME .*/var/lib/detour' || fail "no VOLUME for /var/lib/detour"
# A CUDA-enabled LibTorch is a build argument: its prefix reaches CMake and
# runtime_packages.sh, and the bases are arguments too.
joined=$(sed -e ':a' -e '/\\$/N; s/\\\n//; ta' "$file")
grep -q '^ARG BUILD_BASE=' "$file" || fail "no ARG BUILD_BASE"
grep -q '^ARG RUNTIME_BASE=' "$file" || fail "no ARG RUNTIME_BASE"
grep -q '^FROM ${RUNTIME_BASE} AS runtime' "$file" || fail "the runtime stage is not FROM \${RUNTIME_BASE}"
grep -q '^ARG TORCH_PREFIX=' "$file" || fail "no ARG TORCH_PREFIX (a CUDA-enabled LibTorch)"
grep -q 'CMAKE_PREFIX_PATH=$TORCH_PREFIX' <<< "$joined" || fail "TORCH_PREFIX does not reach CMAKE_PREFIX_PATH"
grep -q 'runtime_packages.sh ${TORCH_PREFIX:+--provided=$TORCH_PREFIX}' <<< "$joined" ||
  fail "runtime_packages.sh is not told that TORCH_PREFIX's libraries come with the base"
grep -q 'install_deps.sh ${TORCH_PREFIX:+--without-torch}' <<< "$joined" ||
  fail "install_deps.sh installs Debian's LibTorch beside TORCH_PREFIX's"
if printf '%s' "$runtime" | grep -Eq 'install_deps|build-essential|-dev\b|cmake --build'; then
  fail "the runtime stage installs build tools or -dev packages"
fi
for ignore in .containerignore .dockerignore; do
  if [[ ! -f "$src/$ignore" ]]; then
    fail "no $ignore"
    continue
  fi
  for pattern in build/ build-\*/ .git/ demo-out/; do
    grep -qxF "$pattern" "$src/$ignore" || fail "$ignore does not exclude $pattern"
  done
done
if ! cmp -s "$src/.containerignore" "$src/.dockerignore"; then
  fail ".containerignore and .dockerignore differ"
fi

pkgs=$("$src/tools/runtime_packages.sh" "$build/coordinator/detour-coordinator" \
         "$build/tools/detourctl/detourctl") || fail "runtime_packages.sh failed"
grep -qx 'libgrpc++1.51' <<< "$pkgs" || fail "runtime_packages.sh misses libgrpc++1.51: $pkgs"
if grep -q -- '-dev$' <<< "$pkgs"; then fail "runtime_packages.sh names -dev packages: $pkgs"; fi
echo "runtime packages of the coordinator and detourctl: $(tr '\n' ' ' <<< "$pkgs")"
# --provided: libraries under a directory the runtime base supplies are left out.
libstdcxx=$(ldd "$build/tools/detourctl/detourctl" | awk '/libstdc\+\+/ {print $3}')
provided=$("$src/tools/runtime_packages.sh" "--provided=$(dirname "$(readlink -f "$libstdcxx")")" \
             "$build/tools/detourctl/detourctl") || fail "runtime_packages.sh --provided failed"
if grep -qx 'libstdc++6' <<< "$provided"; then
  fail "runtime_packages.sh --provided still names libstdc++6: $provided"
fi

if [[ $failures -gt 0 ]]; then
  echo "$failures failures"
  exit 1
fi
echo "static checks passed"

engine=
for candidate in podman docker; do
  if command -v "$candidate" > /dev/null && timeout 10 "$candidate" info > /dev/null 2>&1; then
    engine=$candidate
    break
  fi
done
if [[ -z "$engine" ]]; then
  echo "no working container engine (docker/podman info failed): image build skipped"
  exit 77
fi
tag=detour-test:$$
trap '"$engine" rmi -f "$tag" > /dev/null 2>&1 || true' EXIT
"$engine" build -f "$file" -t "$tag" "$src"
"$engine" run --rm "$tag" detourctl --version
"$engine" run --rm "$tag" detour-coordinator --version
[[ $("$engine" run --rm "$tag" id -u) != 0 ]] || { echo "FAIL: the image runs as root"; exit 1; }
echo "image built and runs as a non-root user"
