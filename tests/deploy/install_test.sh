#!/usr/bin/env bash
# `cmake --install` into a temporary DESTDIR, then checks what a fresh host
# gets: every daemon and tool (each answers --version with the project's
# version), the systemd units, the sysusers.d user and tmpfiles.d directories
# (applied to the DESTDIR root by systemd-sysusers / systemd-tmpfiles), the
# defaults files, the Python client package (importable from the install
# tree alone, on the python's own path for the prefix), and that the units
# pass `systemd-analyze verify` and
# `systemd-analyze security --offline` under a threshold (each unit's score
# is printed).
#
#   install_test.sh BUILD_DIR [SECURITY_THRESHOLD]   (threshold in tenths: 25 = 2.5)
set -euo pipefail
build=$(cd "$1" && pwd)
threshold=${2:-25}
dest=$(mktemp -d "${TMPDIR:-/tmp}/detour-install.XXXXXX")
trap 'rm -rf "$dest"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
prefix=$(cache CMAKE_INSTALL_PREFIX)
version=$(sed -n 's/^CMAKE_PROJECT_VERSION:[A-Z]*=//p' "$build/CMakeCache.txt")
[[ -n "$version" ]] || version=$(grep -o 'project(detour VERSION [0-9.]*' "$(cache CMAKE_HOME_DIRECTORY)/CMakeLists.txt" | awk '{print $3}')
sysconf=$prefix/etc
[[ "$prefix" == /usr ]] && sysconf=/etc

DESTDIR=$dest cmake --install "$build" > "$dest.log" 2>&1 || { cat "$dest.log"; rm -f "$dest.log"; fail "cmake --install"; exit 1; }
rm -f "$dest.log"
root=$dest$prefix

# 1. The file list.
programs=(detour-coordinator detour-worker detourctl detour-local detour-sim detour-eval detour-train detour-checkpoint)
expected=()
for p in "${programs[@]}"; do expected+=("$root/bin/$p"); done
expected+=(
  "$root/lib/systemd/system/detour-coordinator.service"
  "$root/lib/systemd/system/detour-worker.service"
  "$root/lib/systemd/system/detour-worker@.service"
  "$root/lib/sysusers.d/detour.conf"
  "$root/lib/tmpfiles.d/detour.conf"
  "$dest$sysconf/default/detour-coordinator"
  "$dest$sysconf/default/detour-worker"
  "$root/share/detour/deploy/prometheus.yml"
  "$root/share/detour/deploy/k8s/base/workers/workers.yaml"
  "$root/share/detour/deploy/k8s/overlays/single-cluster/kustomization.yaml"
  "$root/share/detour/examples/jobs/tiny_local.json"
  "$root/share/detour/deploy/grafana/detour-dashboard.json"
  "$root/share/detour/deploy/etcd/etcd.default.example"
  "$root/share/doc/detour/OPERATIONS.md"
)
for f in "${expected[@]}"; do
  [[ -f "$f" ]] || fail "not installed: ${f#$dest}"
done
# Every program the build made (an executable named detour* or detourctl
# outside tests/ and benchmarks/) is installed: a new tool cannot be forgotten.
while read -r built; do
  name=$(basename "$built")
  [[ -x "$root/bin/$name" ]] || fail "built but not installed: $name (${built#$build/})"
done < <(find "$build/coordinator" "$build/worker" "$build/tools" -maxdepth 2 -type f -perm -u+x \
           \( -name 'detour-*' -o -name detourctl \) ! -name '*.so' 2>/dev/null)

# 2. Each installed binary runs and reports the version.
for p in "${programs[@]}"; do
  [[ -x "$root/bin/$p" ]] || continue
  if ! out=$("$root/bin/$p" --version 2>&1); then
    fail "$p --version exited non-zero: $out"
  elif [[ "$out" != "$p $version "* ]]; then
    fail "$p --version printed \"$out\", expected \"$p $version (...)\""
  else
    echo "ok: $out"
  fi
done

# 2b. The Python client package, when the build made it (python/CMakeLists.txt).
python=$(cache DETOUR_PYTHON_FOUND)
pydir=$(cache DETOUR_PYTHON_PACKAGE_DIR)
if [[ -n "$python" && -n "$pydir" ]]; then
  [[ "$pydir" == /* ]] || pydir=$prefix/$pydir
  pkg=$dest$pydir/detour
  for f in __init__.py client.py py.typed _proto/detour/v1/job_service_pb2.py \
           _proto/detour/v1/job_service_pb2_grpc.py _proto/detour/v1/control_service_pb2_grpc.py; do
    [[ -f "$pkg/$f" ]] || fail "not installed: ${pkg#$dest}/$f"
  done
  # Imported from the install tree, not the build's copy: nothing else on the path.
  if out=$(cd / && env -u PYTHONPATH PYTHONPATH="$dest$pydir" PYTHONDONTWRITEBYTECODE=1 "$python" -c '
import sys, detour
from detour._proto.detour.v1 import job_service_pb2_grpc
assert detour.__file__.startswith(sys.argv[1]), detour.__file__
spec = detour.load_spec({"name": "x", "pipeline": {"skipRatio": 0.25}})
assert spec.pipeline.skip_ratio == 0.25
print(detour.__version__)' "$dest$pydir" 2>&1); then
    [[ "$out" == "$version" ]] && echo "ok: python3 -c 'import detour' from ${pydir}: version $out" ||
      fail "the installed detour package reports version \"$out\", expected $version"
  else
    fail "the installed detour package does not import: $out"
  fi
  (cd / && PYTHONPATH="$dest$pydir" PYTHONDONTWRITEBYTECODE=1 "$python" -m detour --help > /dev/null 2>&1) ||
    fail "python3 -m detour --help failed from the install tree"
  # Unless DETOUR_PYTHON_INSTALL_DIR chose otherwise, the python finds it without PYTHONPATH.
  if [[ -z "$(cache DETOUR_PYTHON_INSTALL_DIR)" ]]; then
    "$python" -c 'import sys; sys.exit(sys.argv[1] not in sys.path)' "$pydir" ||
      echo "note: $pydir is not on $python's sys.path (the prefix has no site directory)"
  fi
  [[ -z "$(find "$pkg" -name __pycache__ -o -name '.proto-*')" ]] || fail "byte code or temporary files installed under ${pkg#$dest}"
else
  echo "skip: the Python client package (left out of this build)"
fi

# 3. The units name installed paths.
units=("$root"/lib/systemd/system/detour-*.service)
for u in "${units[@]}"; do
  exec_path=$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$u")
  [[ -x "$dest$exec_path" ]] || fail "$(basename "$u"): ExecStart $exec_path is not installed"
  while read -r envfile; do
    [[ -f "$dest$envfile" || "$envfile" == *%i ]] || fail "$(basename "$u"): EnvironmentFile $envfile is not installed"
  done < <(sed -n 's/^EnvironmentFile=-\{0,1\}\(.*\)/\1/p' "$u")
done

# 4. sysusers.d and tmpfiles.d applied to the DESTDIR as root.
mkdir -p "$dest/etc"
printf 'root:x:0:0:root:/root:/bin/sh\n' > "$dest/etc/passwd"
printf 'root:x:0:\nvideo:x:44:\nrender:x:105:\n' > "$dest/etc/group"
if systemd-sysusers --root="$dest" "$root/lib/sysusers.d/detour.conf" > /dev/null 2>&1; then
  grep -q '^detour:x:[0-9]*:[0-9]*:.*:/var/lib/detour:' "$dest/etc/passwd" || fail "sysusers.d did not create the detour user"
  grep -q '^video:x:44:detour' "$dest/etc/group" || fail "sysusers.d did not add detour to video"
else
  fail "systemd-sysusers refused $root/lib/sysusers.d/detour.conf"
fi
if systemd-tmpfiles --root="$dest" --create "$root/lib/tmpfiles.d/detour.conf" 2>&1 | grep .; then
  fail "systemd-tmpfiles complained"
fi
[[ -d "$dest$sysconf/detour/tls" ]] || fail "tmpfiles.d did not create $sysconf/detour/tls"
perm=$(stat -c %a "$dest$sysconf/detour/tls" 2>/dev/null || echo missing)
[[ "$perm" == 750 ]] || fail "$sysconf/detour/tls has mode $perm, expected 750"

# 4b. The units and defaults files name the configured prefix's paths (and
# /etc only where the prefix puts its configuration there): what they say
# is where the files are (docs/OPERATIONS.md §Install, the table).
for f in "$root"/lib/systemd/system/detour*.service "$dest$sysconf"/default/detour-*; do
  while read -r path; do
    case "$path" in
      "$prefix"/* | "$sysconf"/* | /var/lib/* | /run/* | /srv/*) ;;
      *) fail "${f#$dest} names $path, outside the prefix $prefix and $sysconf" ;;
    esac
  done < <(grep -o '/\(usr\|etc\)/[A-Za-z0-9_./@%-]*detour[A-Za-z0-9_./@%-]*' "$f" | sort -u)
done

# 5. systemd-analyze verify and security, on copies whose ExecStart points
# into the DESTDIR (verify checks the binary exists). Any word from verify is
# a failure: it warns about unknown keys but still exits 0.
work=$dest/verify
mkdir -p "$work"
for u in "${units[@]}"; do
  name=$(basename "$u")
  [[ "$name" == *@.service ]] && name=${name/@./@0.}
  sed "s|^ExecStart=$prefix/bin/|ExecStart=$root/bin/|" "$u" > "$work/$name"
done
for u in "$work"/*.service; do
  name=$(basename "$u")
  out=$(cd "$work" && systemd-analyze verify "./$name" 2>&1) || fail "systemd-analyze verify $name failed: $out"
  [[ -z "$out" ]] && echo "ok: systemd-analyze verify $name" || fail "systemd-analyze verify $name: $out"
  score=$(cd "$work" && systemd-analyze security --offline=yes "./$name" 2>&1 | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
  if (cd "$work" && systemd-analyze security --offline=yes --threshold="$threshold" "./$name" > /dev/null 2>&1); then
    echo "ok: systemd-analyze security $name: $score (threshold $((threshold / 10)).$((threshold % 10)))"
  else
    fail "systemd-analyze security $name: $score, above the threshold $((threshold / 10)).$((threshold % 10))"
  fi
done

if [[ $failures -gt 0 ]]; then
  echo "$failures failures"
  exit 1
fi
echo "install test passed: $(find "$dest" -type f | wc -l) files under DESTDIR$prefix"
