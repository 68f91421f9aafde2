#!/usr/bin/env bash
# Prints the Debian packages that hold the shared libraries the given
# programs load (ldd, then dpkg -S), one per line, sorted: what a runtime
# image must install instead of the build stage's -dev packages.
#
#   tools/runtime_packages.sh [--provided=DIR]... /stage/usr/bin/*
#
# --provided=DIR: libraries under DIR come with the runtime image's base
# (e.g. a CUDA-enabled LibTorch in /opt/libtorch), not from a package.
#
# Exit status 1 when a library belongs to no package (it would be missing at
# run time) or a program is not dynamically linked as expected.
set -euo pipefail

provided=()
while [[ $# -gt 0 && "$1" == --provided=* ]]; do
  provided+=("$(readlink -f "${1#--provided=}")")
  shift
done
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [--provided=DIR]... PROGRAM..." >&2
  exit 2
fi
is_provided() {
  local real dir
  real=$(readlink -f "$1")
  for dir in "${provided[@]}"; do
    [[ "$real" == "$dir"/* ]] && return 0
  done
  return 1
}

# Every library the programs load, once.
declare -A libs=()
for program in "$@"; do
  [[ -f "$program" && -x "$program" ]] || continue
  # Scripts have no libraries.
  if ! head -c 4 "$program" | grep -q $'\x7fELF'; then continue; fi
  while read -r lib; do
    is_provided "$lib" || libs["$lib"]=1
  done < <(ldd "$program" | awk '/=> \// {print $3} /^\t\/[^ ]+ \(/ {print $1}')
done

# One dpkg-query for all of them, trying each library's merged-/usr
# spellings (dpkg knows /lib/x86_64-linux-gnu/libc.so.6, ldd may say /usr/lib/...).
declare -A spelled=()  # candidate path -> library
for lib in "${!libs[@]}"; do
  real=$(readlink -f "$lib")
  for candidate in "$lib" "$real" "${lib#/usr}" "${real#/usr}" "/usr${lib}" "/usr${real}"; do
    spelled["$candidate"]=$lib
  done
done
declare -A packages=() found=()
while IFS= read -r line; do
  pkg=${line%%: *}
  path=${line#*: }
  [[ -n "${spelled[$path]:-}" ]] || continue
  found["${spelled[$path]}"]=1
  for p in ${pkg//,/ }; do packages["${p%%:*}"]=1; done
done < <(dpkg-query -S "${!spelled[@]}" 2>/dev/null || true)

status=0
for lib in "${!libs[@]}"; do
  if [[ -z "${found[$lib]:-}" ]]; then
    echo "runtime_packages: $lib is loaded but no installed package holds it" >&2
    status=1
  fi
done
printf '%s\n' "${!packages[@]}" | sort
exit $status
