#!/usr/bin/env bash
# Installs the Debian packages detour builds and tests with. Idempotent: when every
# package is already present it only checks (well under a second) and exits 0.
#
#   tools/install_deps.sh            install what is missing (needs root or sudo)
#   tools/install_deps.sh --check    list what is missing; exit 1 if anything is
#   tools/install_deps.sh --without-torch   leave Debian's (CPU-only) LibTorch out:
#                                    the build uses another one (CMAKE_PREFIX_PATH),
#                                    e.g. a CUDA-enabled one (docs/OPERATIONS.md §GPUs)
set -euo pipefail

check=false
without_torch=false
for arg in "$@"; do
  case "$arg" in
    --check) check=true ;;
    --without-torch) without_torch=true ;;
    *) echo "usage: $0 [--check] [--without-torch]" >&2; exit 2 ;;
  esac
done

PACKAGES=(
  build-essential cmake pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev
  libtorch-dev libgloo-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcivetweb-dev civetweb
  prometheus
  curl iperf3 iproute2 iputils-ping
  clang-14 libclang-rt-14-dev clang-format-14 ccache lld
  sentencepiece
  libssl-dev openssl
  python3-grpcio python3-grpc-tools python3-protobuf python3-numpy
  systemd yamllint python3-yaml mypy
  etcd-server etcd-client
)
if $without_torch; then
  kept=()
  for p in "${PACKAGES[@]}"; do
    [[ "$p" == libtorch-dev || "$p" == libgloo-dev ]] || kept+=("$p")
  done
  PACKAGES=("${kept[@]}")
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

if $check; then
  echo "install_deps: missing: ${missing[*]}" >&2
  exit 1
fi

echo "install_deps: installing ${missing[*]}"
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "install_deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing or stale on a fresh machine.
$SUDO apt-get update -qq
# prometheus is only wanted for promtool; skip its recommends (and its service).
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install_deps: done"
