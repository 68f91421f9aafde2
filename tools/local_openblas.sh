#!/bin/sh
# Puts Debian's OpenBLAS in front of the reference BLAS for one shell, without
# installing it (installing libopenblas0-pthread would switch libblas.so.3
# system-wide through Debian's alternatives, and every CPU timing taken on the
# reference BLAS would no longer compare):
#
#   eval "$(tools/local_openblas.sh [DIR])"
#
# Unpacks libopenblas0-pthread into DIR (default /tmp/oblas) with
# `apt-get download` + `dpkg-deb -x` when it is not there yet, checks that the
# library is there, and prints the two exports a benchmark needs:
# LD_LIBRARY_PATH (the OpenBLAS libblas.so.3 first) and OPENBLAS_NUM_THREADS=1
# (each detour process sets its own LibTorch threads; OpenBLAS's own pool would
# oversubscribe the cores). Progress and errors go to stderr.
# docs/BENCHMARKS.md §"bf16 mixed precision" says what it changes.
set -eu

case "${1:-}" in
  -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "$0: unknown option $1 (usage: $0 [DIR])" >&2; exit 2 ;;
esac
[ "$#" -le 1 ] || { echo "usage: $0 [DIR]" >&2; exit 2; }
dir=${1:-/tmp/oblas}
pkg=libopenblas0-pthread
lib=usr/lib/x86_64-linux-gnu/openblas-pthread

if [ ! -e "$dir/$lib/libblas.so.3" ]; then
  for tool in apt-get dpkg-deb; do
    command -v "$tool" >/dev/null 2>&1 || {
      echo "$0: $tool not found (a Debian system is needed)" >&2
      exit 1
    }
  done
  mkdir -p "$dir"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "$0: downloading $pkg into $dir" >&2
  (cd "$tmp" && apt-get download "$pkg" >&2) || {
    echo "$0: apt-get download $pkg failed (no Debian mirror reachable?)" >&2
    exit 1
  }
  dpkg-deb -x "$tmp"/"$pkg"_*.deb "$dir"
  [ -e "$dir/$lib/libblas.so.3" ] || {
    echo "$0: $pkg unpacked into $dir but $lib/libblas.so.3 is not there" >&2
    exit 1
  }
fi

libdir=$(cd "$dir/$lib" && pwd)
echo "export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} OPENBLAS_NUM_THREADS=1"
